"""The kernel layer: each primitive is one function, chosen once at load.

    primitive         PyTorch twin (torch_ops)      CPU kernel (cpu, C++)
    linear            F.linear                      small_gemm up to 8 bf16 rows (AVX512-BF16,
                                                    or AVX2 on bf16 widened to float32)
    quant_linear      dequantize, then F.linear     int8 dot products on the blocks up to a few
                                                    rows (AVX512-VNNI, or AVX2's vpmaddubsw);
                                                    past that, dequantize;
                                                    int8 per-channel weights: W8A8, VNNI dot
                                                    products or oneDNN's integer GEMM
    dequantize        float math on the blocks      one pass
    rms_norm          float32 math                  one pass
    add_rms_norm      x + residual, then norm       one pass, in place
    rotary_embedding  rotate-half                   one pass, in place
    decode_attention  gather + SDPA                 reads K/V in place via the block table
    add_lora          per segment: x @ A, @ B       short segments: shrink and expand in one
                                                    call (AVX512-BF16 or float32); long: oneDNN
    moe_group         softmax, topk, argsort,       one pass: softmax, top-k, counting sort,
                      index_select                  row gather
    moe_combine       mul, index_add                one pass per token over its pairs

On a GPU (`kernel_backend="triton"`, pagoda/ops/triton_ops.py): attention (the
K/V slot write, split-KV decode, varlen prefill over the paged context),
add_rms_norm and rotary_embedding are Triton kernels; the products are cuBLAS's
(`F.linear`); the rest is the PyTorch twin on the device.

With `batch_invariant` the CPU backend runs each product in one kernel at every row
count and attention per query row (see cpu.cpu_ops): a request's results then do not
depend on its batch.

`select_ops(kernel_backend, dtype)` builds the `Ops` a model is constructed
with; layers call `self.ops.<primitive>` and never ask which CPU they run on.
Every kernel is tested against its twin (tests/kernels/test_cpu_kernels.py,
tests/kernels/test_attention.py, tests/kernels/test_triton_kernels.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pagoda.ops import cpu
from pagoda.ops.base import TORCH_OPS, Ops

__all__ = ["KERNEL_BACKENDS", "TORCH_OPS", "Ops", "gpu_ops", "select_ops"]

logger = logging.getLogger(__name__)

KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")


def select_ops(
    kernel_backend: str,
    dtype: torch.dtype,
    int8_activations: bool = True,
    batch_invariant: bool = False,
) -> Ops:
    """The ops for a model in `dtype`: "torch" is PyTorch alone; "cpu" requires the C++
    kernels; "auto" takes them when they build and support the dtype.

    `int8_activations`: quantized linears at small batch quantize their activations to
    int8 per block of 32 (as llama.cpp does); off, activations stay in `dtype`.
    `batch_invariant`: the C++ kernels' batch-invariant set (see cpu.cpu_ops), required.
    """
    if kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(
            f"kernel_backend must be one of {KERNEL_BACKENDS}, got {kernel_backend!r}."
        )
    if kernel_backend == "torch":
        return TORCH_OPS
    if kernel_backend == "triton":
        return gpu_ops()
    ops = cpu.cpu_ops(dtype, int8_activations, batch_invariant)
    if ops is None and batch_invariant:
        raise ValueError(
            f"batch_invariant: needs pagoda's C++ CPU kernels (AVX512-BF16 or AVX2) for {dtype} "
            "(float32 or bfloat16 models; see the log for a build error)."
        )
    if ops is None:
        if kernel_backend == "cpu":
            raise ValueError(
                f"kernel_backend 'cpu': the C++ kernels are unavailable for {dtype} "
                "(they cover float32 and bfloat16; see the log for a build error)."
            )
        return TORCH_OPS
    return ops


def gpu_ops() -> Ops:
    """The GPU backend. On the CPU it runs only in Triton's interpreter
    (TRITON_INTERPRET=1, set before triton is imported): how the tests run it."""
    import os

    try:
        import pagoda.ops.triton_ops as tr
    except ImportError as e:
        raise ValueError("kernel_backend 'triton' needs the triton package.") from e
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "kernel_backend 'triton' needs a CUDA device (on the CPU: Triton's interpreter, "
            "TRITON_INTERPRET=1, for tests)."
        )
    return replace(
        TORCH_OPS,
        backend="triton",
        add_rms_norm=tr.add_rms_norm,
        rotary_embedding=tr.rotary_embedding,
        decode_attention=tr.decode_attention,
        attention=tr.paged_attention,
    )
