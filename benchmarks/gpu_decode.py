"""Decode step time on a GPU against its bandwidth floor, one command:

    python benchmarks/gpu_decode.py [--model M] [--batch-sizes 1 64 256] [--context 512]
        [--bandwidth-gb-s 4800] [--output-json F]

A decode step must read every weight once and each sequence's K/V: its floor is
(weight bytes + batch x context x K/V bytes per token) / HBM bandwidth (an H200's
HBM3e: 4.8 TB/s). Reported per batch size: the measured step (CUDA graphs on, and
with --enforce-eager for comparison), the floor, and their ratio (the issue's target
at batch 256: within 2x). Prompts of --context tokens, 64 tokens out each.
"""

from __future__ import annotations

import argparse
import json

import torch

from pagoda.bench.latency import run_latency
from pagoda.bench.report import machine_info, versions


def weight_and_kv_bytes(engine_kwargs: dict) -> tuple[int, int]:
    """(bytes of the model's weights on the device, K/V bytes per token)."""
    from pagoda import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(**{**engine_kwargs, "enforce_eager": True}))
    runner = engine.model_runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    per_token = runner.bytes_per_block // engine.cache_config.block_size
    return weights, per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--bandwidth-gb-s", type=float, default=4800.0, help="HBM, GB/s")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode.py needs a CUDA device.")
    base = dict(model=ns.model, device="cuda", dtype=ns.dtype, max_num_seqs=max(ns.batch_sizes))
    weights, kv_per_token = weight_and_kv_bytes(base)
    rows = []
    for eager in (False, True):
        for row in run_latency({**base, "enforce_eager": eager}, ns.batch_sizes, ns.context,
                               ns.output_len):  # fmt: skip
            context = ns.context + ns.output_len / 2  # the mean context of a decode step
            floor_ms = (
                1000
                * (weights + row["batch_size"] * context * kv_per_token)
                / (ns.bandwidth_gb_s * 1e9)
            )
            row.update(
                cuda_graphs=not eager,
                floor_ms=floor_ms,
                ratio_to_floor=row["decode_step_ms"] / floor_ms,
            )
            rows.append(row)
            print(
                f"batch {row['batch_size']:4d} {'eager ' if eager else 'graphs'}: decode step "
                f"{row['decode_step_ms']:.3f} ms, floor {floor_ms:.3f} ms "
                f"({row['ratio_to_floor']:.2f}x), {row['decode_tok_s']:.0f} tok/s",
                flush=True,
            )
    if ns.output_json:
        record = {
            "machine": machine_info(),
            "versions": versions(),
            "config": {**vars(ns), "weight_bytes": weights, "kv_bytes_per_token": kv_per_token},
            "runs": rows,
        }
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
