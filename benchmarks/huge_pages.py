"""Weights on 4 KiB pages against transparent huge pages: `quant_linear` over a real
model's layers (distinct weights per layer, so every call streams from memory).

    python benchmarks/huge_pages.py [--formats q4_0 q8_0] [--rows 1 4 16] [--rounds 9]
        [--output-json docs/perf/huge_pages.json]

Both copies of the weights sit in fresh anonymous mappings laid out alike; one is
advised for huge pages (pagoda.model_executor.huge_pages), the other not. The two run
in turn in one process, and each figure is the median of `--rounds` passes over every
layer. Shapes: Qwen3-1.7B's 28 layers (q, k, v, o, gate, up, down).
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap

import torch

from pagoda.bench.machine_limits import paired_medians
from pagoda.bench.report import machine_info
from pagoda.model_executor.huge_pages import huge_page_buffer
from pagoda.model_executor.quantization import BLOCK, FORMATS
from pagoda.ops import cpu

HIDDEN, KV, MLP, LAYERS = 2048, 1024, 6144, 28
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN),
          (MLP, HIDDEN), (HIDDEN, MLP)] * LAYERS  # fmt: skip


def plain_buffer(nbytes: int) -> torch.Tensor:
    """Like huge_page_buffer, not advised: 4 KiB pages (the kernel's "madvise" mode)."""
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(area, dtype=torch.uint8)


def layers(buffer_of, block_bytes: int, seed: int = 0):
    """(qs, d) for every shape, in one buffer from `buffer_of`, random codes and scales."""
    sizes = [(n, k // BLOCK) for n, k in SHAPES]
    total = sum(n * nb * (block_bytes + 2) for n, nb in sizes)
    buffer = buffer_of(total)
    gen = torch.Generator().manual_seed(seed)
    out, at = [], 0
    for n, nb in sizes:
        qs = buffer[at : at + n * nb * block_bytes].view(n, nb, block_bytes)
        at += qs.numel()
        qs.copy_(torch.randint(0, 256, qs.shape, dtype=torch.uint8, generator=gen))
        d = buffer[at : at + n * nb * 2].view(torch.float16).view(n, nb)
        at += n * nb * 2
        d.copy_(torch.rand(d.shape, generator=gen) * 0.01)
        out.append((qs, d))
    return out, total


def run(module, weights, x: dict[int, torch.Tensor], code: int) -> None:
    for qs, d in weights:
        module.quant_linear(x[qs.shape[1] * BLOCK], qs, d, None, code, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", choices=("q4_0", "q8_0"), default=["q4_0", "q8_0"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = cpu.load()
    if module is None or not module.quant_linear_available():
        raise SystemExit("quant_linear needs pagoda's CPU kernels with AVX512-VNNI")
    if huge_page_buffer(1) is None:
        raise SystemExit("this kernel has no transparent huge pages")
    results = []
    for fmt in args.formats:
        block_bytes = 32 if fmt == "q8_0" else 16
        sets = {
            "4k": layers(plain_buffer, block_bytes),
            "huge": layers(huge_page_buffer, block_bytes),
        }
        for rows in args.rows:
            x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, MLP)}

            code = FORMATS.index(fmt)
            runs = {
                name: functools.partial(run, module, weights, x, code)
                for name, (weights, _) in sets.items()
            }
            median = paired_medians(runs, args.rounds)
            nbytes = sets["4k"][1]
            row = {
                "format": fmt, "rows": rows, "weight_mb": round(nbytes / 1e6, 1),
                "ms_4k": round(median["4k"] * 1e3, 2), "ms_huge": round(median["huge"] * 1e3, 2),
                "gb_s_4k": round(nbytes / median["4k"] / 1e9, 1),
                "gb_s_huge": round(nbytes / median["huge"] / 1e9, 1),
                "speedup": round(median["4k"] / median["huge"], 3),
            }  # fmt: skip
            results.append(row)
            print(json.dumps(row))
    if args.output_json:
        report = {
            "command": "python benchmarks/huge_pages.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if k != "output_json"
            ),
            "machine": machine_info(),
            "shapes": "Qwen3-1.7B: 28 layers of q, k, v, o, gate, up, down",
            "method": "one process; both copies in turn each round; median of rounds",
            "results": results,
        }  # fmt: skip
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
