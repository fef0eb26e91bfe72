"""The CPU backend of the kernel layer: C++ kernels compiled on first use with
torch's extension builder (cached per CPU).

Decode attention, the small-M bf16 GEMM, fused RMSNorm and rotary (sources in
`pagoda/csrc/`). If the compiler or ninja is missing, `load()` returns None and
the model runs on PyTorch alone.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time

import torch

from pagoda.attention.paged import batch_invariant_attention
from pagoda.model_executor.quantization import PER_CHANNEL, QuantizedWeight, StackedWeight
from pagoda.ops import torch_ops
from pagoda.ops.base import Ops

logger = logging.getLogger(__name__)

_SOURCES = [
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc", name)
    for name in (
        "module.cpp",
        "paged_decode.cpp",
        "small_gemm.cpp",
        "fused_ops.cpp",
        "quant_gemm.cpp",
        "kquant_gemm.cpp",
        "quant_gemm_avx2.cpp",
        "w8a8_gemm.cpp",
        "decode_loop.cpp",
        "lora.cpp",
        "moe.cpp",
    )
]


def _cpu_tag() -> str:
    # -march=native code must never be reused on another CPU: key the build by its flags.
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


# A build interrupted (Ctrl-C on the first start) leaves torch's lock file behind, and
# every later build waits on it forever; a build takes minutes, so an older lock is stale.
_STALE_LOCK_S = 15 * 60


def remove_stale_lock(build_dir: str) -> bool:
    lock = os.path.join(build_dir, "lock")
    try:
        if time.time() - os.path.getmtime(lock) < _STALE_LOCK_S:
            return False
        os.remove(lock)
    except OSError:  # no lock (the usual case), or removed meanwhile
        return False
    logger.warning("removed a stale lock left by an interrupted kernel build: %s", lock)
    return True


@functools.cache
def load():
    """The compiled module (decode attention, small-M GEMM, fused norm and rotary),
    or None if it cannot be built."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        name = f"pagoda_cpu_kernels_{_cpu_tag()}"
        remove_stale_lock(_get_build_directory(name, verbose=False))
        logger.info("Building pagoda's CPU kernels (first use only; cached afterwards)...")
        return load_extension(
            name=name,
            sources=_SOURCES,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++20"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform: fall back
        logger.warning("CPU kernels unavailable (%s); using PyTorch alone.", e)
        return None


# Up to this many rows, bf16 products go to small_gemm (benchmarks/cpu_kernels.py, distinct
# weights per layer): 1.3-2.1x oneDNN at one row, 1.2-1.5x at 4-8, about even at 16,
# 0.86x at 64 (AMD EPYC). With the weight stream prefetched, on Sapphire Rapids (SmolLM2's
# 30 layers): 9.1 ms at one row, 16.4 vs oneDNN's 21.7 at 8, even at 12, 26.4 vs 22.5
# at 16. Decode at small batch is a stream of every weight once per step, which
# small_gemm reads with no packing step.
SMALL_GEMM_MAX_ROWS = 8


def bucket_rows(num_rows: int) -> int:
    """`num_rows` rounded up to one of a few dozen sizes (at most 12.5% more, plus 7).

    oneDNN compiles a GEMM kernel (bf16, int8) for every distinct M it sees and keeps it: a
    server whose steps have ever-new token counts grew by 0.7 MiB per new M and
    weight shape (measured: 1,500 distinct M on one 1536x576 weight, +1 GiB RSS;
    bucketed, +54 MiB and flat). fp32 goes to MKL, which does not grow.
    """
    step = max(8, (1 << (num_rows.bit_length() - 1)) // 8)  # 8 sizes per octave past 64
    return -(-num_rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, in] with zero rows appended up to bucket_rows(M) (the caller keeps [:M])."""
    num_rows = x.shape[0]
    rows = bucket_rows(num_rows)
    if rows == num_rows:
        return x
    padded = x.new_empty(rows, x.shape[1])
    padded[:num_rows] = x
    padded[num_rows:].zero_()
    return padded


# Up to this many rows, quantized linears run on the blocks (int8 activations); past it
# the weight is dequantized and oneDNN's GEMM runs on it. The crossover, measured on
# SmolLM2's 30 q4_1 layers (Sapphire Rapids, 2 threads): 3.2 ms at one row, 20 ms at
# 16 rows either way, then 39 vs 22 ms at 32: bf16's GEMM (AMX, or AVX512-BF16) outruns
# the integer products early.
QUANT_LINEAR_MAX_ROWS = 16
# float32's GEMM does not: on AVX2 alone (AMD EPYC of the Zen 3 class, 2 threads;
# benchmarks/quant_linear_rows.py) the blocks are 1.77-2.48x the dequantized product at
# 64 rows and 0.96-1.55x at 256 on SmolLM2's and a 1.7B model's MLP weights (the larger
# the weight, the further they lead), 0.87-1.32x at 512-1,024.
# (float32 with int8 activations on AVX512-VNNI takes the same limit unmeasured: VNNI's
# integer rate is a larger multiple of float32's there than AVX2's is here.)
QUANT_LINEAR_MAX_ROWS_FLOAT32 = 256
# Except large weights in the 4-bit formats without a fifth or sixth bit, whose kernels
# are the fastest: they keep their blocks at every row count. The same CPU, blocks over
# dequantized at 256-2,048 rows (docs/perf/quant_linear_rows_large_avx2.json): q4_0,
# q4_1 and q4_k weights of 2.1-12.6M elements (a 1.7B model's attention and MLP)
# 1.13-1.96x (one 0.97x), where q8_0, q5_0 and q6_k are 0.71-1.07x and weights of
# 0.3-0.9M elements 0.79-1.18x; Qwen3-1.7B's prefill 1.34x in Q4_0 and in Q4_K_M.
# (float32 on AVX512-VNNI takes the rule unmeasured, its integer rate further ahead.)
BLOCKS_AT_ANY_ROWS_FORMATS = ("q4_0", "q4_1", "q4_k")
BLOCKS_AT_ANY_ROWS_MIN_ELEMENTS = 1 << 21


def quant_linear_max_rows(dtype: torch.dtype, weight: QuantizedWeight | None = None) -> int:
    """The most rows at which a block-quantized linear (`weight`, where given) runs on
    its blocks, for a model whose dense products are in `dtype`."""
    if dtype == torch.bfloat16:
        return QUANT_LINEAR_MAX_ROWS
    if (
        weight is not None
        and weight.format in BLOCKS_AT_ANY_ROWS_FORMATS
        and weight.shape[0] * weight.shape[1] >= BLOCKS_AT_ANY_ROWS_MIN_ELEMENTS
    ):
        return 1 << 62
    return QUANT_LINEAR_MAX_ROWS_FLOAT32


CPU_FLAGS = (
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx2",
    "fma",
    "f16c",
)


@functools.cache
def cpu_flags() -> dict[str, bool]:
    """Which of CPU_FLAGS /proc/cpuinfo lists (all False where it cannot be read)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return {name: name in flags for name in CPU_FLAGS}


# w8a8 weights: VNNI dot products up to this many rows, oneDNN's integer GEMM past
# it. Measured on SmolLM2's 30 layers (Sapphire Rapids, 2 threads): 12.4 vs 13.0 ms at
# 8 rows, 17.1 vs 13.7 at 16 (bf16: 28.9 and 23.6). Past W8A8_INT_MAX_ROWS the weight is
# dequantized for oneDNN's bf16 GEMM where that is faster, on AMX tiles: 39 vs 49 ms at
# 128 rows, 144 vs 140 at 512, 487 vs 215 at 2,048. Without AMX, oneDNN's integer GEMM
# (VNNI) stays ahead at every size: 1.4-1.9x bf16's GFLOP/s at 64 to 4,096 rows on
# 384x1536, 1536x384 and 6144x2048 weights (AMD EPYC, 2 threads; benchmarks/w8a8_gemm.py),
# so it runs them all. With neither VNNI nor AMX (AVX2 alone) oneDNN's integer GEMM is
# 23x slower than float32's, so int8_linear_large runs our own there (w8a8_gemm.cpp's
# gemm_avx2): 1.2-4.3x float32's F.linear from 64 to 4,096 rows on five shapes (AMD EPYC
# of the Zen 3 class, 2 threads; benchmarks/w8a8_gemm.py --dtype float32). Past 8 rows it
# is ahead of the small kernel too, but for the largest weights, up to about 16 rows (a
# scratch timing on 2048x8192: 2.5 against 2.2 ms at 8 rows, 4.1 against 4.7 at 16).
INT8_SMALL_MAX_ROWS = 8
_FAST_INT8_GEMM = (
    cpu_flags()["avx512_vnni"] or cpu_flags()["avx_vnni"] or cpu_flags()["amx_int8"]
    or all(cpu_flags()[name] for name in ("avx2", "fma", "f16c"))
)  # fmt: skip
W8A8_INT_MAX_ROWS = (
    256 if cpu_flags()["amx_tile"] else 1 << 62 if _FAST_INT8_GEMM else INT8_SMALL_MAX_ROWS
)
# Of each adapter segment, the most rows that are a multiple of this go to oneDNN's GEMMs
# (so they see at most max_num_batched_tokens / 512 distinct M, each of which oneDNN keeps
# a kernel for, and the expand adds into y in place), and the rest (every segment of a
# decode step) to the C++ lora_add. One step's LoRA products, SmolLM2's 30 layers at rank
# 16 in bf16 (AMD EPYC, 2 threads, benchmarks/cpu_kernels.py): lora_add 0.5 ms at one row
# where the GEMMs take 8, 3.6 at 64 rows (9.4), 13 at 256 (15); past that the GEMMs win
# (their calls cost about 60 us per linear and segment, which lora_add saves at decode).
LORA_GEMM_ROWS = 512
# The C++ decode loop takes steps of up to this many rows, each linear dispatched by its
# rows as `linear` and `quant_linear` below dispatch them.
DECODE_LOOP_MAX_ROWS = 64


def cpu_ops(dtype: torch.dtype, int8_activations: bool = True, batch_invariant: bool = False):
    """The `Ops` with the C++ kernels for a model in `dtype`, or None if they cannot serve it.

    `batch_invariant`: each product runs one kernel at every row count, with one order
    of sums per output element (small_gemm, quant_linear on the blocks, the W8A8
    integer paths, whose int32 sums are exact), and attention runs every query row
    through the decode kernel, whose split depends on the row's position alone: a
    request's results then do not depend on what else is in the step, nor on how its
    prompt was chunked or cached. None where the kernels it needs are not built."""
    module = load()
    if module is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    if batch_invariant and not module.small_gemm_available():
        return None
    linear = torch_ops.linear
    small_gemm = None
    if batch_invariant:
        small_gemm = module.small_gemm

        def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
            return small_gemm(x, weight, bias)

    elif dtype == torch.bfloat16:
        small_gemm = module.small_gemm if module.small_gemm_available() else None

        def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
            num_rows = x.shape[0]
            if small_gemm is not None and num_rows <= SMALL_GEMM_MAX_ROWS:
                return small_gemm(x, weight, bias)
            return torch_ops.linear(pad_rows(x), weight, bias)[:num_rows]

    def dequantize(weight: QuantizedWeight, out_dtype: torch.dtype) -> torch.Tensor:
        if isinstance(weight, StackedWeight):
            return torch.cat([dequantize(piece, out_dtype) for piece in weight.pieces])
        if weight.format == PER_CHANNEL:
            out = torch.empty(weight.shape, dtype=out_dtype)
            module.int8_dequantize(weight.qs, weight.d, out)
            return out
        code = weight.format_code
        return module.dequantize(
            weight.qs, weight.d, weight.m, code, out_dtype, qh=weight.qh, sc=weight.sc
        )

    on_blocks = int8_activations and module.quant_linear_available()
    int8_small = int8_activations and module.int8_linear_small_available()
    # Where large-batch products dequantize their weight: one buffer, reused, so that a
    # weight's worth of fresh pages is not faulted in at every call (most of the cost).
    scratch: dict[torch.dtype, torch.Tensor] = {}

    # Batch-invariant: integer paths at every row count (the dequantized GEMM past them
    # sums in another order); without int8 activations, dequantize + small_gemm always.
    w8a8_int_max_rows = W8A8_INT_MAX_ROWS if not batch_invariant else 1 << 62
    if batch_invariant:
        blocks_max_rows = lambda weight: 1 << 62  # noqa: E731
    else:
        blocks_max_rows = functools.partial(quant_linear_max_rows, dtype)

    def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        if isinstance(weight, StackedWeight):  # each piece on its own kernel
            return torch.cat([quant_linear(x, p, b) for p, b in weight.split(bias)], -1)
        if weight.format == PER_CHANNEL and int8_activations:
            x = x.contiguous()
            if int8_small and x.shape[0] <= INT8_SMALL_MAX_ROWS:
                return module.int8_linear_small(x, weight.qs, weight.d, bias)
            if x.shape[0] <= w8a8_int_max_rows:
                # Bucketed rows, as for bf16: oneDNN keeps an integer kernel per distinct M.
                y = module.int8_linear_large(pad_rows(x), weight.qs, weight.d, bias)
                return y[: x.shape[0]]
        if on_blocks and weight.format != PER_CHANNEL and x.shape[0] <= blocks_max_rows(weight):
            blocks = (weight.qs, weight.d, weight.m, weight.format_code)
            return module.quant_linear(x.contiguous(), *blocks, bias, qh=weight.qh, sc=weight.sc)
        numel = weight.shape[0] * weight.shape[1]
        buffer = scratch.get(x.dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = scratch[x.dtype] = torch.empty(numel, dtype=x.dtype)
        if weight.format == PER_CHANNEL:
            dense = buffer[:numel].view(weight.shape)
            module.int8_dequantize(weight.qs, weight.d, dense)
        else:
            blocks = (weight.qs, weight.d, weight.m, weight.format_code)
            dense = module.dequantize(*blocks, x.dtype, buffer, weight.qh, weight.sc)
        return linear(x, dense, bias)

    # The most rows `linear` gives small_gemm (bf16), for the decode loop's dense products.
    dense_small_rows = 0 if small_gemm is None else SMALL_GEMM_MAX_ROWS
    if batch_invariant:
        dense_small_rows = 1 << 62

    def decode_loop_linear(weight: torch.Tensor | None, qweight, bias):
        """(the C++ decode loop's LinearSpec for a linear, the most rows at which it runs
        it exactly as `linear`/`quant_linear` above do), or None if it cannot. The loop
        dispatches by rows as they do: `small_rows`, its small-batch kernel's most."""
        kinds, spec = module.LinearKind, module.LinearSpec
        if qweight is None:
            if batch_invariant and weight.dtype == torch.float32:
                return None  # (the loop's float32 product is F.linear's)
            dense = spec(kind=kinds.DENSE, w=weight, bias=bias)  # (the loop's dense_small_rows)
            return dense, DECODE_LOOP_MAX_ROWS
        if isinstance(qweight, StackedWeight):
            pieces = [decode_loop_linear(None, p, b) for p, b in qweight.split(bias)]
            if None in pieces:
                return None
            stacked = spec.stacked([piece for piece, _ in pieces])
            return stacked, min(rows for _, rows in pieces)
        if qweight.format == PER_CHANNEL:
            if not int8_small:
                return None
            per_channel = spec(kind=kinds.PER_CHANNEL, w=qweight.qs, d=qweight.d, bias=bias,
                               small_rows=INT8_SMALL_MAX_ROWS)  # fmt: skip
            # (past INT8_SMALL_MAX_ROWS, int8_linear_large: the loop never dequantizes w8a8)
            return per_channel, min(DECODE_LOOP_MAX_ROWS, w8a8_int_max_rows)
        if not on_blocks:
            return None
        blocks = spec(
            kind=kinds.BLOCKS, w=qweight.qs, d=qweight.d, m=qweight.m, qh=qweight.qh,
            sc=qweight.sc, format=qweight.format_code, bias=bias,
            small_rows=blocks_max_rows(qweight),
        )  # fmt: skip
        return blocks, DECODE_LOOP_MAX_ROWS

    add_lora = torch_ops.add_lora
    if module.lora_add_available():
        gemm_rows = LORA_GEMM_ROWS if not batch_invariant else 1 << 62  # (lora_add: per row)

        def add_lora(y: torch.Tensor, x: torch.Tensor, lora, mapping) -> torch.Tensor:
            blocks, rest = mapping.split(gemm_rows)
            if blocks:
                torch_ops.add_lora_segments(y, x, lora, blocks)
            if rest is not None:
                module.lora_add(y, x, lora.a, lora.b, lora.ranks, lora.offsets, rest)
            return y

    def moe_group(x, router_logits, top_k, renormalize):
        xs, token_of, weights, counts = module.moe_group(x, router_logits, top_k, renormalize)
        return xs, token_of, weights, counts.tolist()

    def add_rms_norm(x, residual, weight, eps):
        module.fused_add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def rotary_embedding(qk, positions, cos, sin):
        module.rotary_embedding(qk, positions, cos, sin)
        return qk

    return Ops(
        backend="cpu",
        linear=linear,
        quant_linear=quant_linear,
        dequantize=dequantize,
        rms_norm=module.rms_norm,
        add_rms_norm=add_rms_norm,
        rotary_embedding=rotary_embedding,
        decode_attention=module.paged_decode_attention,
        add_lora=add_lora,
        moe_group=moe_group,
        moe_combine=module.moe_combine,
        decode_loop=functools.partial(module.DecodeLoop, dense_small_rows=dense_small_rows),
        decode_loop_linear=decode_loop_linear,
        decode_loop_lora=module.lora_add_available(),
        attention=(
            functools.partial(batch_invariant_attention, module.paged_decode_attention)
            if batch_invariant
            else None
        ),
    )
