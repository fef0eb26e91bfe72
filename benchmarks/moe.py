"""Mixture of experts on the CPU: a decode step of a Mixtral-shaped model against a
dense model with the same active parameters, and what the routing costs.

    python benchmarks/moe.py [--batch-sizes 1,64] [--steps 48] [--quantization q4_1]

Two random models in bf16, saved as Hugging Face folders (nothing downloaded), the
same but for the MLP: `moe` has 8 experts of intermediate size 1536 with 2 chosen
per token; `dense` one MLP of intermediate size 3072 (= 2 x 1536: the same
parameters active per token). Both: hidden 1024, 8 layers, 16 heads, 4 KV heads.
Each model runs twice, with the C++ decode loop (the default; it takes steps of
up to 8 bf16 rows, so B=64 steps go through Python either way) and with
--enforce-eager.

For each batch size B: B requests of 16 prompt tokens decode together; the figure
is the median time of the steps after every prompt is in (`--steps` of them).
Then one expert layer alone at each B: its forward (with the C++ moe_group and
moe_combine, and with their PyTorch twins) against its expert products alone on
the same grouping; the difference (the router's softmax and top-k, the sort,
gather, weighting and sum) is the overhead of routing and grouping, given per
layer and as a share of the MoE model's step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from pagoda import LLMEngine, SamplingParams  # noqa: E402
from pagoda.bench.report import machine_info  # noqa: E402
from pagoda.engine_args import EngineArgs  # noqa: E402
from pagoda.model_executor.layers import fused_moe  # noqa: E402
from pagoda.ops import select_ops  # noqa: E402
from tests.helpers import make_model  # noqa: E402  (the tests' tiny tokenizer)

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    initializer_range=0.02,
)


def expert_layer_ms(batch: int, repeats: int = 200) -> dict[str, float]:
    """One MoE layer of the benchmark's shape in bf16 at `batch` tokens, in ms: its
    forward with the C++ grouping and combine, with their PyTorch twins, and its
    expert products alone on the same grouping."""
    import dataclasses

    import torch.nn.functional as F

    from pagoda.ops import torch_ops

    ops = select_ops("cpu", torch.bfloat16)
    twins = dataclasses.replace(
        ops, moe_group=torch_ops.moe_group, moe_combine=torch_ops.moe_combine
    )
    moe = fused_moe.FusedMoE(8, 2, SHAPE["hidden_size"], 1536, True, ops)
    moe.w13.data = torch.randn(moe.w13.shape, dtype=torch.bfloat16) * 0.02
    moe.w2.data = torch.randn(moe.w2.shape, dtype=torch.bfloat16) * 0.02
    x = torch.randn(batch, SHAPE["hidden_size"], dtype=torch.bfloat16)
    logits = torch.randn(batch, 8, dtype=torch.bfloat16)
    xs, _, _, counts = ops.moe_group(x, logits, 2, True)

    def products():
        start = 0
        for expert, n in enumerate(counts):
            if n:
                seg = xs[start : start + n]
                gate, up = ops.linear(seg, moe.w13[expert], None).chunk(2, dim=-1)
                ops.linear(F.silu(gate) * up, moe.w2[expert], None)
                start += n

    def with_ops(layer_ops):
        def run():
            moe.ops = layer_ops
            moe(x, logits)

        return run

    def best(fn) -> float:
        for _ in range(20):
            fn()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1000 * (time.perf_counter() - t) / repeats

    return {
        "kernels": best(with_ops(ops)),
        "twins": best(with_ops(twins)),
        "products": best(products),
    }


def decode_steps(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median decode step time (s) with `batch` requests decoding."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{batch}-{i}", {"prompt_token_ids": [5 + i % 50] * 16}, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--quantization", default="none", help="the models' weights at load, e.g. q4_1")
    ap.add_argument("--output-json")
    ns = ap.parse_args()
    batches = [int(b) for b in ns.batch_sizes.split(",")]
    root = tempfile.mkdtemp()
    torch.set_default_dtype(torch.bfloat16)  # the saved weights: bf16, as served
    moe_dir = make_model(f"{root}/moe", "mixtral", **SHAPE, intermediate_size=1536,
                         num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
    dense_dir = make_model(f"{root}/dense", "llama", **SHAPE, intermediate_size=3072)
    torch.set_default_dtype(torch.float32)
    info = machine_info()
    print(f"{info.get('cpu', '')}, {torch.get_num_threads()} threads")
    rows = {}
    for name, folder, eager in (
        ("dense (C++ decode loop)", dense_dir, False),
        ("dense (eager)", dense_dir, True),
        ("moe (C++ decode loop)", moe_dir, False),
        ("moe (eager)", moe_dir, True),
    ):
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=folder,
                dtype="bfloat16",
                enforce_eager=eager,
                kv_cache_memory_bytes=256 << 20,
                quantization=ns.quantization,
            )  # fmt: skip
        )
        decode_steps(engine, 4, 8)  # warm up the kernels' shapes
        rows[name] = [decode_steps(engine, b, ns.steps) for b in batches]
        del engine
    weights = "bf16" if ns.quantization == "none" else f"{ns.quantization} weights, bf16"
    print(f"\ndecode step, median of {ns.steps} steps ({weights}, hidden 1024, 8 layers):")
    print(f"{'model':<26}" + "".join(f"{f'B={b} ms':>12}" for b in batches))
    for name, results in rows.items():
        print(f"{name:<26}" + "".join(f"{1000 * t:>12.2f}" for t in results))
    layer_ms = {}
    for i, b in enumerate(batches):
        ms = layer_ms[b] = expert_layer_ms(b)
        layers = SHAPE["num_hidden_layers"]
        overhead = ms["kernels"] - ms["products"]
        t_moe = rows["moe (C++ decode loop)"][i]
        print(
            f"B={b}: moe / dense, C++ loops {t_moe / rows['dense (C++ decode loop)'][i]:.2f}x, "
            f"eager {rows['moe (eager)'][i] / rows['dense (eager)'][i]:.2f}x. One expert "
            f"layer: {ms['kernels']:.3f} ms (with the PyTorch twins for grouping and combine: "
            f"{ms['twins']:.3f}), its expert products alone {ms['products']:.3f}: routing and "
            f"grouping {overhead:.3f} ms, {100 * overhead / ms['kernels']:.0f}% of the layer, "
            f"{100 * layers * overhead / (1000 * t_moe):.1f}% of the loop's step"
        )
    if ns.output_json:
        result = {
            "command": " ".join(["python", *sys.argv]), "machine": info, "steps": ns.steps,
            "quantization": ns.quantization, "batch_sizes": batches,
            "decode_step_ms": {name: [1000 * t for t in ts] for name, ts in rows.items()},
            "expert_layer_ms": layer_ms,
        }  # fmt: skip
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
