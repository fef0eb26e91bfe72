"""This machine's limits, measured in this process with the torch threads the engine set:
read bandwidth, the GEMM peaks (bf16, fp32; bf16 without AMX where the CPU has AMX) and
the int8 peak of pagoda's integer products. A few seconds in all.

Every figure is the best of a few timed runs after one untimed run (page faults,
oneDNN's kernel creation), so it is what the hardware gives, not a typical call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.bench.report import cpu_name
from pagoda.model_executor.quantization import PER_CHANNEL, QuantizedWeight
from pagoda.ops.cpu import cpu_flags

# oneDNN's best ISA without AMX tiles: set in a child process, it measures bf16 GEMMs as
# a CPU without AMX would run them.
NO_AMX_ISA = "AVX512_CORE_BF16"
GEMM_ROWS = 512  # "large M": oneDNN's GEMMs at their best
INT8_ROWS = (16, 64)  # the integer product at decode sizes, and past them
FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass
class MachineLimits:
    """What `measure_limits` found; `peaks_gflops` by path: "bf16", "fp32" (and "fp16"
    for a float16 model), "int8" (GOP/s; absent where `int8_missing` says why)."""

    cpu: str
    flags: dict[str, bool]
    num_threads: int
    read_gbs: float
    read_bytes: int
    gemm_shape: tuple[int, int]  # [out, in] of the model's largest linear (not lm_head)
    gemm_rows: int
    peaks_gflops: dict[str, float]
    int8_format: str | None = None  # the block format (or w8a8) the int8 peak ran on
    int8_by_rows: dict[int, float] = field(default_factory=dict)
    int8_missing: str | None = None
    bf16_no_amx_gflops: float | None = None  # bf16 with oneDNN kept off AMX tiles
    no_amx_note: str | None = None

    @property
    def has_amx(self) -> bool:
        return self.flags.get("amx_tile", False)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def paired_medians(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Each run's median seconds, the runs timed in turn each round (after one untimed
    call each), so that a drift in the machine falls on all of them alike."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def read_bandwidth_gbs(num_bytes: int, repeats: int) -> float:
    """GB/s of one `sum` over a float32 tensor of `num_bytes` (make it much larger than
    the L3 cache: a sum reads every byte once and writes nothing)."""
    x = torch.ones(num_bytes // 4)  # (ones, not empty: every page is touched before timing)
    return num_bytes / best_seconds(x.sum, repeats) / 1e9


def gemm_gflops(shape: tuple[int, int], rows: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of F.linear: x [rows, in] times a weight [out, in], in `dtype`."""
    out_features, in_features = shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    seconds = best_seconds(lambda: F.linear(x, w), repeats)
    return 2 * rows * out_features * in_features / seconds / 1e9


def q4_0_weight(shape: tuple[int, int]) -> QuantizedWeight:
    """A random [out, in] weight in q4_0 blocks, by the `gguf` package's quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagoda.model_executor.quantization import from_gguf

    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return from_gguf("Q4_0", quantize(w.numpy(), GGMLQuantizationType.Q4_0))


def int8_gops(
    weight: QuantizedWeight, rows_list: tuple[int, ...], repeats: int
) -> tuple[dict[int, float], str | None]:
    """({rows: GOP/s}, None) of pagoda's integer product on `weight` (bf16 activations
    quantized to int8 inside the kernel): `quant_linear` on block formats at every row
    count, `int8_linear_small`/`_large` on w8a8 as the engine picks them; or ({}, why
    not) where the C++ kernels are not built or lack the product (no AVX512-VNNI)."""
    from pagoda.ops import cpu

    module = cpu.load()
    if module is None:
        return {}, "pagoda's C++ kernels are not built (no compiler?)"
    if weight.format == PER_CHANNEL:
        if not module.int8_linear_small_available():
            return {}, "int8_linear_small is not built (no AVX512-VNNI)"

        def product(x: torch.Tensor) -> torch.Tensor:
            small = x.shape[0] <= cpu.INT8_SMALL_MAX_ROWS
            kernel = module.int8_linear_small if small else module.int8_linear_large
            return kernel(x, weight.qs, weight.d, None)

    else:
        if not module.quant_linear_available():
            return {}, "quant_linear is not built (no AVX512-VNNI)"

        def product(x: torch.Tensor) -> torch.Tensor:
            code = weight.format_code
            return module.quant_linear(
                x, weight.qs, weight.d, weight.m, code, None, qh=weight.qh, sc=weight.sc
            )

    out_features, in_features = weight.shape
    gops = {}
    for rows in rows_list:
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0))
        x = x.to(torch.bfloat16)
        seconds = best_seconds(lambda x=x: product(x), repeats)
        gops[rows] = 2 * rows * out_features * in_features / seconds / 1e9
    return gops, None


def bf16_gflops_without_amx(
    shape: tuple[int, int], rows: int, repeats: int, num_threads: int
) -> float:
    """`gemm_gflops` in bf16 in a child process where oneDNN may not use AMX tiles
    (ONEDNN_MAX_CPU_ISA is read once, when oneDNN starts: it cannot change here)."""
    code = (
        "import json, sys, torch\n"
        "from pagoda.bench.machine_limits import gemm_gflops\n"
        "shape, rows, repeats, threads = json.loads(sys.argv[1])\n"
        "torch.set_num_threads(threads)\n"
        "print(gemm_gflops(tuple(shape), rows, torch.bfloat16, repeats))\n"
    )
    args = json.dumps([list(shape), rows, repeats, num_threads])
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": NO_AMX_ISA}
    done = subprocess.run(
        [sys.executable, "-c", code, args], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def measure_limits(
    gemm_shape: tuple[int, int],
    int8_weight: QuantizedWeight | None = None,
    float_peaks: tuple[str, ...] = ("bf16", "fp32"),
    read_bytes: int = 1 << 30,
    gemm_rows: int = GEMM_ROWS,
    repeats: int = 3,
) -> MachineLimits:
    """Measure this machine: read bandwidth over `read_bytes`, GEMM peaks of
    `float_peaks` on `gemm_shape` at `gemm_rows`, the int8 peak on `int8_weight` (a
    random q4_0 weight of `gemm_shape` when None; skipped, with the reason, where the
    shape's input is not whole blocks of 32), and bf16 without AMX where there is AMX."""
    flags = cpu_flags()
    limits = MachineLimits(
        cpu=cpu_name(),
        flags=flags,
        num_threads=torch.get_num_threads(),
        read_gbs=read_bandwidth_gbs(read_bytes, repeats),
        read_bytes=read_bytes,
        gemm_shape=tuple(gemm_shape),
        gemm_rows=gemm_rows,
        peaks_gflops={
            name: gemm_gflops(gemm_shape, gemm_rows, FLOAT_DTYPES[name], repeats)
            for name in float_peaks
        },
    )
    if int8_weight is None and gemm_shape[1] % 32:
        limits.int8_missing = f"the input size {gemm_shape[1]} is not whole blocks of 32"
    else:
        weight = int8_weight if int8_weight is not None else q4_0_weight(gemm_shape)
        limits.int8_format = weight.format
        limits.int8_by_rows, limits.int8_missing = int8_gops(weight, INT8_ROWS, repeats)
        if limits.int8_by_rows:
            limits.peaks_gflops["int8"] = max(limits.int8_by_rows.values())
    if limits.has_amx:
        try:
            limits.bf16_no_amx_gflops = bf16_gflops_without_amx(
                gemm_shape, gemm_rows, repeats, limits.num_threads
            )
        except subprocess.CalledProcessError as e:  # the rest of the figures still stand
            last = (e.stderr or "").strip().splitlines()[-1:] or ["no message"]
            limits.no_amx_note = f"the child process kept off AMX failed: {last[0]}"
    else:
        limits.no_amx_note = "this CPU has no AMX: the bf16 peak above is without AMX"
    return limits
