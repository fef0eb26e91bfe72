"""GGUF's K-quants kept in their super-blocks against the 32-weight blocks pagoda
recoded them into before (Q4_K and Q5_K as q4_1 and q5_1, Q6_K requantized to q8_0:
`QuantizedWeight.in_blocks_of_32`): bytes, and the time
of every K-quant weight of a real file as one decode step's products (`quant_linear`
at 1, 4 and 16 rows) and as prefill's (`dequantize` to bf16).

    python benchmarks/k_quants.py FILE.gguf [--rows 1 4 16] [--rounds 7]
        [--output-json docs/perf/k_quants.json]

FILE: a real-size Q4_K_M file (benchmarks/real_size_models.py writes one). Both sets
sit on transparent huge pages, as the engine keeps weights, and run in turn in one
process; each figure is the median of `--rounds` passes over every weight.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from pagoda.bench.machine_limits import paired_medians
from pagoda.bench.report import machine_info
from pagoda.model_executor.huge_pages import move_to_huge_pages
from pagoda.model_executor.quantization import QuantizedWeight, from_gguf
from pagoda.ops import cpu


def load(path: str) -> dict[str, list[QuantizedWeight]]:
    from gguf import GGUFReader

    kept = []
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type.name in ("Q4_K", "Q5_K", "Q6_K") and len(tensor.shape) == 2:
            kept.append(from_gguf(tensor.tensor_type.name, tensor.data))
    before = [w.in_blocks_of_32() for w in kept]
    sets = {"k_quants": kept, "recoded": before}
    for weights in sets.values():  # on huge pages, as the engine holds them
        holder = torch.nn.Module()
        holder.weights = weights
        move_to_huge_pages(holder)
    return sets


def products(module, weights, x: dict[int, torch.Tensor]) -> None:
    for w in weights:
        module.quant_linear(x[w.shape[1]], w.qs, w.d, w.m, w.format_code, None, qh=w.qh, sc=w.sc)


def dequantize(module, weights, _x) -> None:
    for w in weights:
        module.dequantize(w.qs, w.d, w.m, w.format_code, torch.bfloat16, qh=w.qh, sc=w.sc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = cpu.load()
    if module is None or not module.quant_linear_available():
        raise SystemExit("quant_linear needs pagoda's CPU kernels with AVX512-VNNI")
    sets = load(args.gguf)
    nbytes = {name: sum(w.nbytes for w in ws) for name, ws in sets.items()}
    counts = {}
    for w in sets["k_quants"]:
        counts[w.format] = counts.get(w.format, 0) + 1
    print(json.dumps({"weights": counts, "mb": {k: round(v / 1e6, 1) for k, v in nbytes.items()}}))
    results = []
    widths = {w.shape[1] for w in sets["k_quants"]}
    for what, rows in [("quant_linear", r) for r in args.rows] + [("dequantize", None)]:
        x = {k: torch.randn(rows or 1, k, dtype=torch.bfloat16) for k in widths}
        run = products if what == "quant_linear" else dequantize
        runs = {name: functools.partial(run, module, ws, x) for name, ws in sets.items()}
        median = paired_medians(runs, args.rounds)
        row = {
            "kernel": what, "rows": rows,
            "ms_k_quants": round(median["k_quants"] * 1e3, 2),
            "ms_recoded": round(median["recoded"] * 1e3, 2),
            "gb_s_k_quants": round(nbytes["k_quants"] / median["k_quants"] / 1e9, 1),
            "gb_s_recoded": round(nbytes["recoded"] / median["recoded"] / 1e9, 1),
            "speedup": round(median["recoded"] / median["k_quants"], 3),
        }  # fmt: skip
        results.append(row)
        print(json.dumps(row))
    if args.output_json:
        report = {
            "command": f"python benchmarks/k_quants.py {os.path.basename(args.gguf)} --rows "
            + " ".join(map(str, args.rows)) + f" --rounds {args.rounds} --threads {args.threads}",
            "machine": machine_info(),
            "file": os.path.basename(args.gguf),
            "weights": counts,
            "weight_mb": {k: round(v / 1e6, 1) for k, v in nbytes.items()},
            "method": "one process, both sets on huge pages, in turn each round; median",
            "results": results,
        }  # fmt: skip
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
