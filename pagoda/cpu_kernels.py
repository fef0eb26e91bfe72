"""C++ CPU kernels, compiled on first use with torch's extension builder (cached).

Decode attention, the small-M bf16 GEMM, fused RMSNorm and rotary (sources in
`csrc/`). If the compiler or ninja is missing, `load()` returns None and the
model runs on PyTorch alone.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

logger = logging.getLogger(__name__)

_SOURCES = [
    os.path.join(os.path.dirname(__file__), "csrc", name)
    for name in ("module.cpp", "paged_decode.cpp", "small_gemm.cpp", "fused_ops.cpp")
]


def _cpu_tag() -> str:
    # -march=native code must never be reused on another CPU: key the build by its flags.
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


@functools.cache
def load():
    """The compiled module (decode attention, small-M GEMM, fused norm and rotary),
    or None if it cannot be built."""
    try:
        from torch.utils.cpp_extension import load as load_extension

        logger.info("Building pagoda's CPU kernels (first use only; cached afterwards)...")
        return load_extension(
            name=f"pagoda_cpu_kernels_{_cpu_tag()}",
            sources=_SOURCES,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++20"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform: fall back
        logger.warning("CPU kernels unavailable (%s); using PyTorch alone.", e)
        return None
