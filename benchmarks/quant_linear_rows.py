"""Where a quantized linear should stop running on its blocks: pagoda's int8 product on the
blocks (`quant_linear`, int8 activations) against dequantizing the weight for the
float GEMM, per row count, in one process. The crossover sets
`pagoda.ops.cpu.quant_linear_max_rows` (QUANT_LINEAR_MAX_ROWS for bf16 products,
QUANT_LINEAR_MAX_ROWS_FLOAT32 for float32).

    python benchmarks/quant_linear_rows.py [--output-json docs/perf/quant_linear_rows.json]

Shapes: SmolLM2-135M's MLP (q4_1, the shipped file's type) and a 1.7B model's (q4_0),
random weights quantized by the gguf package, or `--shapes FMT:N:K,...`; with `--gguf
FILE --tensors NAME,...` also those tensors of a GGUF file (the K-quants, which the
package cannot write). The dtype "auto" picks (bf16 where the CPU has it natively, else
float32); best of `--repeats`, the two paths in turn.

With `--prefill MODEL`, end to end instead: one `--prompt-len` prompt prefilled (one
step) by two engines in one process, in turn, best of `--repeats`: every weight
limited to `quant_linear_max_rows(dtype)` (the rule before large 4-bit weights kept
their blocks at every row count) and the rule as it is.
"""

from __future__ import annotations

import argparse
import contextlib
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


@contextlib.contextmanager
def row_rule(rule):
    """`cpu.quant_linear_max_rows` replaced by `rule(dtype, weight)` for what is built
    inside (the ops read it once, when they are built)."""
    saved = cpu.quant_linear_max_rows
    cpu.quant_linear_max_rows = rule
    try:
        yield
    finally:
        cpu.quant_linear_max_rows = saved


def ops_with(max_rows: int, dtype: torch.dtype):
    """The CPU ops with the blocks' row limit set to `max_rows` (0: always dequantize)."""
    with row_rule(lambda _dtype, _weight=None: max_rows):
        return cpu.cpu_ops(dtype)


def weights(shapes, gguf_file: str | None, tensors: list[str]):
    """(label, QuantizedWeight): random weights of `shapes` quantized by the gguf
    package, then `tensors` of `gguf_file` as they are stored."""
    rng = np.random.default_rng(0)
    for kind, out_features, in_features in shapes:
        dense = rng.standard_normal((out_features, in_features), dtype=np.float32) * 0.02
        yield kind, from_gguf(kind.upper(), quantize(dense, GGMLQuantizationType[kind.upper()]))
    if tensors:
        from gguf import GGUFReader

        found = {t.name: t for t in GGUFReader(gguf_file).tensors}
        for name in tensors:
            kind = found[name].tensor_type.name
            yield f"{kind.lower()} ({name})", from_gguf(kind, found[name].data)


def prefill_rules(model: str, prompt_len: int, repeats: int) -> list[dict]:
    """Seconds to prefill a fresh prompt under the row limit per format alone (`before`)
    and under the current rule (`after`), in turn."""
    from pagoda import LLM, SamplingParams

    kwargs = dict(max_model_len=prompt_len + 1, enable_prefix_caching=False,
                  max_num_batched_tokens=max(2048, prompt_len))  # fmt: skip
    rule = cpu.quant_linear_max_rows
    with row_rule(lambda dtype, weight=None: rule(dtype)):  # the limit per dtype alone
        engines = {"before": LLM(model, **kwargs)}
    engines["after"] = LLM(model, **kwargs)
    rng = np.random.default_rng(0)
    best = dict.fromkeys(engines, float("inf"))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for _ in range(repeats):
        for name, llm in engines.items():
            prompt = rng.integers(1000, 30000, prompt_len).tolist()  # fresh: no cache hit
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - start)
    row = {"model": model, "prompt_len": prompt_len, "repeats": repeats,
           **{f"{name}_tok_s": prompt_len / s for name, s in best.items()},
           "after_over_before": best["before"] / best["after"]}  # fmt: skip
    print(f"prefill {prompt_len} tokens: before {row['before_tok_s']:.1f} tok/s, after "
          f"{row['after_tok_s']:.1f} tok/s, {row['after_over_before']:.2f}x")  # fmt: skip
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=None, help="FMT:N:K,... (default: %(prog)s's own)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--gguf", default=None, help="a GGUF file whose --tensors to add")
    ap.add_argument("--tensors", default="", help="NAME,... of --gguf's tensors")
    ap.add_argument("--prefill", default=None, metavar="MODEL", help="end to end (see above)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    module = cpu.load()
    if module is None or not module.quant_linear_available():
        sys.exit("pagoda's int8 block kernels are not built on this CPU")
    if args.prefill:
        results = prefill_rules(args.prefill, args.prompt_len, args.repeats)
        if args.output_json:
            config = {"repeats": args.repeats, "dtype": "auto (float32 with int8 activations where the CPU lacks native bf16)"}  # fmt: skip
            write_json(args.output_json, config, results)
        return
    dtype = DTYPES[resolve_dtype("auto", {})]  # bf16 where native, else float32
    paths = {"blocks": ops_with(1 << 30, dtype), "dequantized": ops_with(0, dtype)}
    shapes = SHAPES
    if args.shapes:
        shapes = [(f, int(n), int(k)) for f, n, k in (s.split(":") for s in args.shapes.split(","))]
    results = []
    for kind, weight in weights(shapes, args.gguf, [t for t in args.tensors.split(",") if t]):
        out_features, in_features = weight.shape
        for rows in map(int, args.rows.split(",")):
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
