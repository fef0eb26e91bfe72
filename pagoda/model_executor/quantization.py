"""Weights kept in GGUF's block formats: q8_0, q4_0, q4_1.

A `QuantizedWeight` is an [N, K] matrix stored as blocks of 32 weights along K, one
fp16 scale each (and a minimum for q4_1), repacked at load into one array per part
so that each kernel reads its part contiguously:

    qs  uint8 [N, K/32, 16]  4-bit: element j of a block in byte j's low nibble,
                             element j + 16 in its high nibble (as GGUF has them)
        uint8 [N, K/32, 32]  8-bit: stored + 128, so every weight byte is unsigned
    d   float16 [N, K/32]    the block's scale
    m   float16 [N, K/32]    q4_1's block minimum, else None

    weight = d * (q - offset) + m      offset: 8 (q4_0), 128 (q8_0), 0 (q4_1)

The kernels (pagoda.ops) run linear layers on it directly; nothing is expanded to a
float matrix in memory except, transiently, for a prefill-sized product.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block, every format
FORMATS = ("q8_0", "q4_0", "q4_1")  # index = the C++ kernels' format code
OFFSETS = {"q8_0": 128, "q4_0": 8, "q4_1": 0}
_BLOCK_BYTES = {"q8_0": 32, "q4_0": 16, "q4_1": 16}  # qs bytes a block
# GGUF's raw block: (fp16 fields before the quants, quant bytes)
_GGUF_LAYOUT = {"Q8_0": ("q8_0", 1, 32), "Q4_0": ("q4_0", 1, 16), "Q4_1": ("q4_1", 2, 16)}
GGUF_TYPES = tuple(_GGUF_LAYOUT)  # the GGUF tensor types kept quantized


@dataclass
class QuantizedWeight:
    format: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    @property
    def format_code(self) -> int:
        return FORMATS.index(self.format)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight's rows `index` (a gather: an embedding lookup, a row permutation)."""
        m = self.m[index] if self.m is not None else None
        return QuantizedWeight(self.format, self.qs[index], self.d[index], m)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack weights of one format along N (fused q/k/v, gate/up)."""
        formats = {p.format for p in parts}
        if len(formats) != 1:
            raise ValueError(f"cannot fuse weights of formats {sorted(formats)}")
        m = torch.cat([p.m for p in parts]) if parts[0].m is not None else None
        return QuantizedWeight(
            parts[0].format, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m
        )


def from_gguf(type_name: str, data: np.ndarray) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [rows, blocks * block bytes]) repacked."""
    fmt, num_halves, quant_bytes = _GGUF_LAYOUT[type_name]
    rows = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(rows, -1, 2 * num_halves + quant_bytes)
    halves = raw[:, :, : 2 * num_halves].copy().view(np.float16)  # [rows, nb, num_halves]
    qs = raw[:, :, 2 * num_halves :]
    if fmt == "q8_0":
        qs = (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    d = torch.from_numpy(np.ascontiguousarray(halves[:, :, 0]))
    m = torch.from_numpy(np.ascontiguousarray(halves[:, :, 1])) if num_halves == 2 else None
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(qs)), d, m)
