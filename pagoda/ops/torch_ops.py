"""The PyTorch twin of every primitive: the reference the fast kernels are checked
against, and what runs where no kernel is available."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.model_executor.quantization import OFFSETS, QuantizedWeight

linear = F.linear  # (x [T, in], weight [out, in], bias [out] | None) -> [T, out]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and rounded where Hugging Face rounds."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """qk [T, heads, D] rotated at `positions` [T] (rotate-half layout); cos/sin
    [max_position, D/2] float32."""
    cos = cos[positions].unsqueeze(1).to(qk.dtype)  # [T, 1, D/2]
    sin = sin[positions].unsqueeze(1).to(qk.dtype)
    x1, x2 = qk.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, KVH, D], block_table [..., MB] -> [..., MB * bs, KVH, D]."""
    return cache[block_table].flatten(-4, -3)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    q [B, H, D]; caches [N, bs, KVH, D]; block_tables [B, MB]; seq_lens [B] -> [B, H, D].
    """
    keys = gather_blocks(k_cache, block_tables).transpose(1, 2)  # [B, KVH, S, D]
    values = gather_blocks(v_cache, block_tables).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=q.device)
    mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A block-quantized [N, K] weight as a float matrix in `dtype`."""
    qs = weight.qs
    q = qs.float() if weight.format == "q8_0" else torch.cat((qs & 0x0F, qs >> 4), -1).float()
    d = weight.d.float().unsqueeze(-1)  # [N, nb, 1]
    w = (q - OFFSETS[weight.format]) * d  # exact: an 8-bit integer times an fp16 scale
    if weight.m is not None:
        w = w + weight.m.float().unsqueeze(-1)
    return w.reshape(weight.shape).to(dtype)


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ dequantize(weight).T + bias, activations as they are (W4A16 / W8A16)."""
    return F.linear(x, dequantize(weight, x.dtype), bias)
