"""w8a8's integer GEMM (oneDNN through `int8_linear_large`: VNNI, or AMX-INT8 where the
CPU has it) against bf16 `F.linear` on the same shapes, at the row counts where
`pagoda.ops.cpu.W8A8_INT_MAX_ROWS` decides which runs.

    python benchmarks/w8a8_gemm.py [--output-json docs/perf/w8a8_gemm.json]
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

SHAPES = [(1536, 384), (384, 1536), (6144, 2048)]  # [out, in]: all-MiniLM's MLP, a 1.7B's
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
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    module = cpu.load()
    if module is None:
        sys.exit("pagoda's C++ kernels are not built")
    results = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        q, dense = quantize_per_channel(w), w.bfloat16()
        for rows in ROWS:
            x = torch.randn(rows, k).bfloat16()
            int8 = best_s(lambda x=x, q=q: module.int8_linear_large(x, q.qs, q.d, None))
            bf16 = best_s(lambda x=x, dense=dense: F.linear(x, dense))
            gflop = 2 * rows * n * k / 1e9
            results.append({"shape": [n, k], "rows": rows, "int8_gops": gflop / int8,
                            "bf16_gflops": gflop / bf16, "int8_x_bf16": bf16 / int8})  # fmt: skip
            print(f"{n}x{k} rows {rows:5d}: int8 {gflop / int8:6.0f} GOP/s  bf16 "
                  f"{gflop / bf16:6.0f} GFLOP/s  {bf16 / int8:.2f}x")  # fmt: skip
    if args.output_json:
        report = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(),
                  "cpu_flags": cpu.cpu_flags(), "threads": torch.get_num_threads(),
                  "results": results}  # fmt: skip
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
