"""Rotary position embedding (Hugging Face's rotate-half layout), cos/sin cached once."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.ops import TORCH_OPS, Ops


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported.")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        ops: Ops = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.ops = ops
        # On the CPU even when the model is built on the meta device (weights come later).
        inv_freq = _inv_freq(head_dim, theta, scaling).cpu()
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        # [max_position, head_dim // 2] each; float32, cast per call to the activations' dtype.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """qk: [T, H + KVH, D], queries and keys side by side -> rotated, same shape
        (possibly in place). One pass over both: half the small ops of rotating q and k apart.
        """
        return self.ops.rotary_embedding(qk, positions, self.cos, self.sin)
