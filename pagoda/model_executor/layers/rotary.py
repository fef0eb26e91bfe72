"""Rotary position embedding (Hugging Face's rotate-half layout), cos/sin cached once.

The tables follow a layer's rope parameters in transformers 5's form (`rope_parameters`:
rope_type, rope_theta, factor, ...): default, linear, dynamic (NTK), llama3, yarn
(DeepSeek's mscale too) and longrope, over the first `partial_rotary_factor` of the head
dims (Phi-4-mini rotates 3/4 of them; the rest pass through).

Two types that transformers recomputes per forward pass are fixed here per position,
so that a token's rotation never depends on what else runs in its batch:
- dynamic: positions within the original context use the plain frequencies (as HF
  does there); position p beyond it uses the base HF would compute for a sequence of
  p + 1 tokens.
- longrope: the long factors for every position when the engine's context
  (max_model_len) exceeds the original one, else the short factors (llama.cpp's rule).
  Equal to HF whenever HF would choose the same set for the whole sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.ops import TORCH_OPS, Ops

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]


def rope_tables(
    params: dict[str, Any],
    head_dim: int,
    num_positions: int,
    max_position_embeddings: int,
    context_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [num_positions, rotary_dim / 2] float32, each times the type's
    attention factor (as HF scales cos and sin). `max_position_embeddings`: the
    config's; `context_len`: the engine's longest sequence (longrope's choice)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}."
        )
    base = float(params.get("rope_theta", 10000.0))
    dim = rotary_dim(head_dim, params)
    inv_freq = 1.0 / (base ** _exponents(dim))  # [dim / 2]
    positions = torch.arange(num_positions, dtype=torch.float32)
    attention_factor = 1.0
    if params.get("freq_factors") is not None:  # a GGUF's rope_freqs (llama3 scaling)
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(base, dim, params, max_position_embeddings)
    elif rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or max_position_embeddings
        long = (context_len or max_position_embeddings) > original
        factors = torch.tensor(
            params["long_factor" if long else "short_factor"], dtype=torch.float32
        )
        inv_freq = 1.0 / (factors * base ** _exponents(dim))
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            factor = params.get("factor") or max_position_embeddings / original
            attention_factor = (
                1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
    if rope_type == "dynamic":
        freqs = _dynamic_freqs(base, dim, params["factor"], max_position_embeddings, positions)
    else:
        freqs = torch.outer(positions, inv_freq)  # [P, dim / 2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN's blend of interpolated and extrapolated frequencies, and its attention
    factor (DeepSeek's: mscale over mscale_all_dim)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # where the extrapolated frequency stays
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _dynamic_freqs(
    base: float, dim: int, factor: float, original: int, positions: torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK per position: the base HF computes for a sequence of p + 1 tokens
    (the plain one within the original context). [P, dim / 2]."""
    beyond = (positions + 1).clamp(min=original).double()
    bases = base * ((factor * beyond / original) - (factor - 1)) ** (dim / (dim - 2))
    exponents = _exponents(dim)
    plain = 1.0 / (base**exponents)  # [dim / 2], as the default type computes it
    scaled = 1.0 / (bases.float()[:, None] ** exponents[None, :])  # [P, dim / 2]
    inv_freq = torch.where((positions < original)[:, None], plain[None, :], scaled)
    return positions[:, None] * inv_freq


class RotaryEmbedding(nn.Module):
    """One rope table (a model may hold several: Gemma 3's local and global layers)."""

    def __init__(
        self,
        head_dim: int,
        num_positions: int,
        params: dict[str, Any],
        max_position_embeddings: int,
        ops: Ops = TORCH_OPS,
        context_len: int | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, params)
        cos, sin = rope_tables(
            params, head_dim, num_positions, max_position_embeddings, context_len
        )
        # [num_positions, rotary_dim // 2] each; float32, cast per call to the activations'
        # dtype. On the CPU even when the model is built elsewhere (weights come later).
        self.register_buffer("cos", cos.contiguous(), persistent=False)
        self.register_buffer("sin", sin.contiguous(), persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """qk: [T, H + KVH, D], queries and keys side by side -> rotated, same shape
        (possibly in place); with partial rotary only the first rotary_dim dims turn.
        One pass over both: half the small ops of rotating q and k apart."""
        return self.ops.rotary_embedding(qk, positions, self.cos, self.sin)
