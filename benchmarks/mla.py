"""Multi-head latent attention against the multi-head attention it compresses, at
DeepSeek-V2-Lite's attention shape: KV bytes per token, and the decode step at a few
thousand tokens of context.

Two models with random weights, built from transformers' configs, in bf16: DeepSeek-V2
(16 heads; q 192 = 128 nope + 64 rope, v 128; kv_lora_rank 512) and a Llama of the
same hidden size with 16 KV heads of 128 (the MHA a latent row stands for, without
the extra rope dims), both with `--layers` dense layers of the same MLP. Each runs
`pagoda bench latency`'s loop in-process: a prompt of `--context` tokens, then decode
steps, at each batch size.

    python benchmarks/mla.py [--context 4000] [--batch-sizes 1,8] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

# The repository, not this folder (whose kernels.py would shadow a package).
sys.path[0] = __file__.rsplit("/benchmarks/", 1)[0]

import torch  # noqa: E402

from pagoda import EngineArgs, LLMEngine  # noqa: E402
from pagoda.bench.latency import run_latency  # noqa: E402
from pagoda.bench.report import machine_info  # noqa: E402
from tests.helpers import make_tokenizer  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
             max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)  # fmt: skip


def build(folder: str, kind: str, layers: int) -> str:
    import transformers

    tokenizer = make_tokenizer(folder)
    vocab = len(tokenizer)
    if kind == "mla":
        config = transformers.DeepseekV2Config(
            **SHAPE, vocab_size=vocab, num_hidden_layers=layers, num_key_value_heads=16,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, n_routed_experts=8, first_k_dense_replace=layers,  # all dense
        )  # fmt: skip
        cls = transformers.DeepseekV2ForCausalLM
    else:
        config = transformers.LlamaConfig(
            **SHAPE, vocab_size=vocab, num_hidden_layers=layers, num_key_value_heads=16
        )
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for kind in ("mla", "mha"):
            folder = build(f"{root}/{kind}", kind, args.layers)
            engine = dict(model=folder, dtype="bfloat16", max_model_len=8192,
                          kv_cache_memory_bytes=6 << 30, max_num_batched_tokens=4096)  # fmt: skip
            small = dict(
                kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_batched_tokens=512
            )
            probe = LLMEngine(EngineArgs(**{**engine, **small}))
            kv = probe.get_stats().kv_cache
            del probe
            results[kind] = {
                "kv_bytes_per_token": kv.bytes_per_token,
                "expanded_kv_bytes_per_token": kv.expanded_bytes_per_token,
                "rows": run_latency(engine, batches, args.context, args.output_len),
            }
    print(
        f"{'':<6} {'KV bytes/token':>15} "
        + " ".join(f"{'step ms B=' + str(b):>14}" for b in batches)
    )
    for kind, r in results.items():
        steps = " ".join(f"{row['decode_step_ms']:>14.1f}" for row in r["rows"])
        print(f"{kind:<6} {r['kv_bytes_per_token']:>15} {steps}")
    report = {
        "command": " ".join(sys.argv),
        "machine": machine_info(),
        "context": args.context,
        "layers": args.layers,
        "results": results,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
