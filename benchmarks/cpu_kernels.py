"""pagoda's C++ CPU kernels against what they replace, one model step's worth each.

    python benchmarks/cpu_kernels.py [--output-json docs/perf/cpu_kernels.json]

Shapes are SmolLM2-135M's (30 layers, hidden 576, 9 query / 3 KV heads of 64,
MLP 1536, vocab 49152), in bf16. Every layer gets its own weights and KV slab,
so nothing is timed out of a warm cache that a real step would not have.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from pagoda.ops import TORCH_OPS, cpu

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 30, 576, 9, 3, 64, 49152
LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
RESULTS: list[dict] = []  # every timing, for --output-json


def report(line: str, **fields) -> None:
    print(line)
    RESULTS.append(fields)


def best_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def linears(kernels) -> None:
    layers = [
        [torch.randn(o, i).bfloat16() * 0.02 for o, i in LINEAR_SHAPES] for _ in range(LAYERS)
    ]
    lm_head = torch.randn(VOCAB, HIDDEN).bfloat16() * 0.02
    weight_gb = (sum(w.numel() for ws in layers for w in ws) + lm_head.numel()) * 2 / 1e9
    for rows in (1, 4, 8, 16, 64):
        xs = [torch.randn(rows, i).bfloat16() for _, i in LINEAR_SHAPES]

        def step(matmul, xs=xs):
            def run():
                for ws in layers:
                    for w, x in zip(ws, xs, strict=True):
                        matmul(x, w)
                matmul(xs[0], lm_head)

            return run

        onednn = best_ms(step(F.linear))
        ours = best_ms(step(lambda x, w: kernels.small_gemm(x, w, None)))
        report(
            f"linears, {rows:>2} rows: oneDNN {onednn:6.1f} ms  small_gemm {ours:6.1f} ms"
            f"  ({onednn / ours:.2f}x; small_gemm streams weights at {weight_gb / ours * 1e3:.0f} GB/s)",
            kernel="small_gemm", rows=rows, onednn_ms=onednn, ours_ms=ours,
        )  # fmt: skip


def decode_attention(kernels, batch: int = 64, context: int = 300, block_size: int = 16) -> None:
    blocks = -(-context // block_size)
    tables = torch.randperm(batch * blocks).view(batch, blocks)  # scattered, as after churn
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    shape = (batch * blocks, block_size, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS)]
    scale = HEAD_DIM**-0.5

    def kernel():
        for k, v in caches:
            kernels.paged_decode_attention(q, k, v, tables, lens, scale)

    def sdpa():  # the PyTorch twin: gather, then one masked SDPA call
        for k, v in caches:
            TORCH_OPS.decode_attention(q, k, v, tables, lens, scale)

    ours, ref = best_ms(kernel, 3), best_ms(sdpa, 3)
    kv_gb = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 * LAYERS / 1e9
    report(
        f"decode attention, B={batch}, context {context}: kernel {ours:.1f} ms"
        f" ({kv_gb / ours * 1e3:.1f} GB/s of K/V), gather + SDPA {ref:.1f} ms ({ref / ours:.1f}x)",
        kernel="paged_decode_attention", batch=batch, context=context, torch_ms=ref, ours_ms=ours,
    )  # fmt: skip


def norm_and_rotary(kernels) -> None:
    from pagoda.model_executor.layers.layernorm import RMSNorm
    from pagoda.model_executor.layers.rotary import RotaryEmbedding

    for rows in (1, 64, 2048):
        norm = RMSNorm(HIDDEN).bfloat16()
        rope = {"rope_type": "default", "rope_theta": 100000.0}
        rotary = RotaryEmbedding(HEAD_DIM, 8192, rope, 8192).bfloat16()
        x, residual = torch.randn(rows, HIDDEN).bfloat16(), torch.randn(rows, HIDDEN).bfloat16()
        qk = torch.randn(rows, HEADS + KV_HEADS, HEAD_DIM).bfloat16()
        positions = torch.randint(0, 8192, (rows,))
        times = {}
        for name, ops in (("torch", TORCH_OPS), ("fused", cpu.cpu_ops(torch.bfloat16))):
            norm.ops = rotary.ops = ops

            times[name] = best_ms(
                lambda norm=norm, rotary=rotary, x=x, r=residual, qk=qk, pos=positions: [
                    (norm(x.clone(), r.clone()), rotary(pos, qk)) for _ in range(LAYERS)
                ]
            )
        report(
            f"add+RMSNorm and rotary, {rows:>4} rows, 30 layers: PyTorch {times['torch']:.2f} ms"
            f"  fused {times['fused']:.2f} ms ({times['torch'] / times['fused']:.1f}x)",
            kernel="add_rms_norm+rotary", rows=rows, torch_ms=times["torch"], ours_ms=times["fused"],
        )  # fmt: skip


def lora(kernels, rank: int = 16, num_adapters: int = 8) -> None:
    """One step's LoRA products (every linear of the 30 layers, rank 16, bf16 slots):
    lora_add against oneDNN's GEMMs per segment (torch_ops.add_lora_segments), for one
    segment and for the rows split over 8 adapters: where LORA_GEMM_ROWS sits."""
    from pagoda.lora.manager import LinearLoRA, LoRAMapping
    from pagoda.ops import torch_ops

    slices = [(HIDDEN, [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]),
              (HIDDEN, [HIDDEN]), (HIDDEN, [1536, 1536]), (1536, [HIDDEN])]  # fmt: skip

    def slots(in_features: int, widths: list[int]) -> LinearLoRA:
        n = len(widths)
        return LinearLoRA(
            torch.randn(num_adapters, n, rank, in_features).bfloat16() * 0.02,
            torch.randn(num_adapters, rank, sum(widths)).bfloat16() * 0.02,
            torch.full((num_adapters, n), rank, dtype=torch.int32),
            [sum(widths[:i]) for i in range(n)],
            widths,
            (),
        )

    layers = [[slots(k, w) for k, w in slices] for _ in range(LAYERS)]
    for rows in (1, 8, 16, 32, 64, 256, 2048):
        for num_segments in (1, 8):
            if num_segments > rows:
                continue
            per = rows // num_segments
            segments = [(i * per, (i + 1) * per, i) for i in range(num_segments)]
            mapping = LoRAMapping(segments, torch.tensor(segments))
            xs = [torch.randn(rows, k).bfloat16() for k, _ in slices]
            ys = [torch.randn(rows, sum(w)).bfloat16() for _, w in slices]

            def step(add, xs=xs, ys=ys, mapping=mapping):
                return lambda: [add(y, x, lo, mapping) for los in layers
                                for lo, x, y in zip(los, xs, ys, strict=True)]  # fmt: skip

            def kernel(y, x, lo, m):
                kernels.lora_add(y, x, lo.a, lo.b, lo.ranks, lo.offsets, m.segment_tensor)

            def gemm(y, x, lo, m):
                torch_ops.add_lora_segments(y, x, lo, m.segments)

            ours, onednn = best_ms(step(kernel), 3), best_ms(step(gemm), 3)
            report(
                f"LoRA rank {rank}, {rows:>4} rows in {num_segments} segment(s): lora_add "
                f"{ours:7.2f} ms  oneDNN GEMMs {onednn:7.2f} ms ({onednn / ours:.2f}x)",
                kernel="lora_add", rows=rows, segments=num_segments, onednn_ms=onednn, ours_ms=ours,
            )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    kernels = cpu.load()
    if kernels is None:
        raise SystemExit("the C++ kernels could not be built (see the log)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if kernels.small_gemm_available():
        linears(kernels)
    else:
        print("small_gemm: not built (this CPU lacks AVX512-BF16)")
    decode_attention(kernels)
    norm_and_rotary(kernels)
    lora(kernels)
    if args.output_json:
        from pagoda.bench.report import machine_info

        report_json = {
            "command": " ".join(["python", *sys.argv]),
            "machine": machine_info(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "results": RESULTS,
        }
        with open(args.output_json, "w") as f:
            json.dump(report_json, f, indent=2)


if __name__ == "__main__":
    main()
