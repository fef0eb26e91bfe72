"""Where a quantized linear should stop running on its blocks: pagoda's int8 product on the
blocks (`quant_linear`, int8 activations) against dequantizing the weight for the
float GEMM, per row count, in one process. The crossover sets
`pagoda.ops.cpu.quant_linear_max_rows` (QUANT_LINEAR_MAX_ROWS for bf16 products,
QUANT_LINEAR_MAX_ROWS_FLOAT32 for float32).

    python benchmarks/quant_linear_rows.py [--output-json docs/perf/quant_linear_rows.json]

Shapes: SmolLM2-135M's MLP (q4_1, the shipped file's type) and a 1.7B model's (q4_0),
random weights quantized by the gguf package; the dtype "auto" picks (bf16 where the CPU
has it natively, else float32); best of `--repeats`, the two paths in turn.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagoda.bench.report import write_json
from pagoda.model_executor.model_loader import resolve_dtype
from pagoda.model_executor.quantization import from_gguf
from pagoda.ops import cpu
from pagoda.worker.model_setup import DTYPES

SHAPES = [("q4_1", 1536, 576), ("q4_1", 576, 1536), ("q4_0", 6144, 2048), ("q4_0", 2048, 6144)]
ROWS = (8, 16, 32, 64, 128, 256, 512, 1024)


def ops_with(max_rows: int, dtype: torch.dtype):
    """The CPU ops with the blocks' row limit set to `max_rows` (0: always dequantize)."""
    saved = cpu.quant_linear_max_rows
    cpu.quant_linear_max_rows = lambda _dtype, _weight=None: max_rows
    try:
        return cpu.cpu_ops(dtype)
    finally:
        cpu.quant_linear_max_rows = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    module = cpu.load()
    if module is None or not module.quant_linear_available():
        sys.exit("pagoda's int8 block kernels are not built on this CPU")
    dtype = DTYPES[resolve_dtype("auto", {})]  # bf16 where native, else float32
    paths = {"blocks": ops_with(1 << 30, dtype), "dequantized": ops_with(0, dtype)}
    rng = np.random.default_rng(0)
    results = []
    for kind, out_features, in_features in SHAPES:
        dense = rng.standard_normal((out_features, in_features), dtype=np.float32) * 0.02
        weight = from_gguf(kind.upper(), quantize(dense, GGMLQuantizationType[kind.upper()]))
        for rows in ROWS:
            x = torch.randn(rows, in_features).to(dtype)
            best = dict.fromkeys(paths, float("inf"))
            for ops in paths.values():
                ops.quant_linear(x, weight)  # warm up
            for _ in range(args.repeats):
                for name, ops in paths.items():
                    start = time.perf_counter()
                    ops.quant_linear(x, weight)
                    best[name] = min(best[name], time.perf_counter() - start)
            row = {"format": kind, "shape": [out_features, in_features], "rows": rows,
                   **{f"{name}_ms": s * 1e3 for name, s in best.items()},
                   "dequantized_over_blocks": best["dequantized"] / best["blocks"]}  # fmt: skip
            results.append(row)
            print(f"{kind} {out_features}x{in_features} rows {rows:4d}: blocks "
                  f"{row['blocks_ms']:8.2f} ms, dequantized {row['dequantized_ms']:8.2f} ms, "
                  f"blocks {row['dequantized_over_blocks']:5.2f}x")  # fmt: skip
    if args.output_json:
        config = {"dtype": str(dtype), "repeats": args.repeats,
                  "cpu_flags": [name for name, present in cpu.cpu_flags().items() if present],
                  "quant_linear_max_rows": cpu.quant_linear_max_rows(dtype)}  # fmt: skip
        write_json(args.output_json, config, results)


if __name__ == "__main__":
    main()
