"""The PyTorch twin of every primitive: the reference the fast kernels are checked
against, and what runs where no kernel is available."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.kv_cache import dequantize_kv, gather
from pagoda.attention.paged import AttentionParams, attend
from pagoda.model_executor.quantization import QuantizedWeight

linear = F.linear  # (x [T, in], weight [out, in], bias [out] | None) -> [T, out]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and rounded where Hugging Face rounds:
    Llama's before the weight; with a float32 weight on lower-precision rows, Gemma's
    after it (the weight then holds 1 + w)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        return (h * weight).to(dtype)
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
    [max_position, R/2] float32 with R <= D (partial rotary: dims R.. pass through)."""
    half = cos.shape[1]
    cos = cos[positions].unsqueeze(1).to(qk.dtype)  # [T, 1, R/2]
    sin = sin[positions].unsqueeze(1).to(qk.dtype)
    x1, x2, rest = qk.split([half, half, qk.shape[-1] - 2 * half], dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    v_dim: int = 0,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    q [B, H, D]; caches [N, bs, KVH, D] (quantized ones with scales [N, bs, KVH]);
    block_tables [B, MB]; seq_lens [B] -> [B, H, Dv]. `window` > 0: each query sees its
    `window` latest keys only (itself included); `softcap` > 0: capped logits; `v_dim`
    > 0: values are the first v_dim dims of each row (MLA's latent rows), else Dv = D.
    """
    keys = gather(k_cache, block_tables)  # [B, S, KVH, D]
    values = gather(v_cache, block_tables)
    query = q
    if k_scales is not None:  # in float32, as the C++ kernel reads a quantized cache
        keys = dequantize_kv(keys, gather(k_scales, block_tables), torch.float32)
        values = dequantize_kv(values, gather(v_scales, block_tables), torch.float32)
        query = q.float()
    if v_dim:
        values = values[..., :v_dim]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, KVH, S, D]
    positions = torch.arange(keys.shape[2], device=q.device)
    mask = positions[None, :] < seq_lens[:, None]  # [B, S]
    if window:
        mask &= positions[None, :] >= (seq_lens - window)[:, None]
    params = AttentionParams(scale, window, softcap)
    if softcap:
        o = torch.cat([
            attend(query[b, None, :, None], keys[b, None], values[b, None], mask[b, None], params)
            for b in range(q.shape[0])
        ])  # fmt: skip
    else:
        o = F.scaled_dot_product_attention(
            query.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale,
            enable_gqa=True,
        )  # fmt: skip
    return o.squeeze(2).to(q.dtype)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A quantized [N, K] weight as a float matrix in `dtype`."""
    return weight.dequantized().to(dtype)


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ dequantize(weight).T + bias, activations as they are (W4A16 / W8A16; the C++
    kernels quantize them)."""
    return F.linear(x, dequantize(weight, x.dtype), bias)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora, mapping) -> torch.Tensor:
    """y [T, out] += each segment's LoRA product, in place: per segment (tokens [start,
    end) on slot s) shrink x @ A^T -> [n, slices * R], then each slice's rank columns
    times B^T's columns of that slice, in the slots' dtype. `lora`: a LinearLoRA (a
    [L, S, R, in], b [L, R, out], zero past each slot's rank); `mapping`: a LoRAMapping."""
    return add_lora_segments(y, x, lora, mapping.segments)


def add_lora_segments(y, x, lora, segments) -> torch.Tensor:
    """`add_lora` over (start, end, slot) segments: one GEMM per segment for the shrink,
    one per slice for the expand, added into y in place."""
    num_slices, rank, in_features = lora.a.shape[1:]
    for start, end, slot in segments:
        ranks = lora.ranks[slot].tolist()
        shrunk = x[start:end].to(lora.a.dtype) @ lora.a[slot].view(-1, in_features).T
        for i, (offset, width) in enumerate(zip(lora.offsets, lora.widths, strict=True)):
            r = ranks[i]
            if r:
                y[start:end, offset : offset + width].addmm_(
                    shrunk[:, i * rank : i * rank + r], lora.b[slot, :r, offset : offset + width]
                )
    return y


def moe_group(
    x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A mixture-of-experts layer's routing and grouping: softmax (float32) over the
    router's logits [T, E], each token's top-k (renormalized to sum 1 or not); the T*k
    (token, expert) pairs sorted by expert, stably. Returns (x's rows in that order
    [T*k, H], each pair's token [T*k], its routing weight [T*k] float32, the pairs
    per expert)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat_ids = ids.reshape(-1)  # pair p is token p // k
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=router_logits.shape[1]).tolist()
    return x.index_select(0, token_of), token_of, weights.reshape(-1)[order], counts


def moe_combine(
    out: torch.Tensor, token_of: torch.Tensor, pair_weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """y [num_tokens, H]: each pair's expert output [T*k, H] times its routing weight,
    summed into its token in pair order."""
    out = out * pair_weights.to(out.dtype).unsqueeze(1)
    return out.new_zeros(num_tokens, out.shape[1]).index_add_(0, token_of, out)
