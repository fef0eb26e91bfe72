"""w8a8's integer GEMM (`int8_linear_large`: oneDNN's with VNNI or AMX-INT8 where the
CPU has them, pagoda's own on AVX2 alone) against `F.linear` in bf16 (or `--dtype
float32`, for CPUs without native bf16) on the same shapes, at the row counts where
`pagoda.ops.cpu.W8A8_INT_MAX_ROWS` decides which runs.

    python benchmarks/w8a8_gemm.py [--dtype float32] [--output-json docs/perf/w8a8_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from pagoda.bench.report import machine_info
from pagoda.model_executor.quantization import quantize_per_channel
from pagoda.ops import cpu

# [out, in]: all-MiniLM's MLP, a 1.7B's, nomic-embed-text's MLP
SHAPES = [(1536, 384), (384, 1536), (6144, 2048), (3072, 768), (768, 3072)]
ROWS = (64, 256, 1024, 4096)


def best_s(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    module = cpu.load()
    if module is None:
        sys.exit("pagoda's C++ kernels are not built")
    results = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        q, dense = quantize_per_channel(w), w.to(dtype)
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            int8 = best_s(lambda x=x, q=q: module.int8_linear_large(x, q.qs, q.d, None))
            fp = best_s(lambda x=x, dense=dense: F.linear(x, dense))
            gflop, name = 2 * rows * n * k / 1e9, "bf16" if dtype == torch.bfloat16 else "fp32"
            results.append({"shape": [n, k], "rows": rows, "int8_gops": gflop / int8,
                            f"{name}_gflops": gflop / fp, f"int8_x_{name}": fp / int8})  # fmt: skip
            print(f"{n}x{k} rows {rows:5d}: int8 {gflop / int8:6.0f} GOP/s  {name} "
                  f"{gflop / fp:6.0f} GFLOP/s  {fp / int8:.2f}x")  # fmt: skip
    if args.output_json:
        report = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(),
                  "cpu_flags": cpu.cpu_flags(), "threads": torch.get_num_threads(), "dtype": args.dtype,
                  "results": results}  # fmt: skip
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
