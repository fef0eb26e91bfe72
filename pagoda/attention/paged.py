"""Paged attention over a flat batch: decodes through the kernel layer's
`decode_attention`, prefill chunks through PyTorch's SDPA.

Every query attends to its request's context, read through the block table,
plus the causally earlier tokens of its own chunk. Decodes are one batched
call; prefill chunks run one SDPA call each (a loop over requests, not
tokens), straight from the new K/V when there is no earlier context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.context import AttentionMetadata
from pagoda.attention.kv_cache import LayerKV, dequantize_kv, gather, quantize_kv, raw


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slots: torch.Tensor) -> None:
    """This step's k, v [T, KVH, D] into the cache at `slots` [T] (quantized if it is)."""
    for x, values, scales in ((k, cache.k, cache.k_scales), (v, cache.v, cache.v_scales)):
        flat = values.view(-1, *x.shape[1:])  # [num_blocks * block_size, KVH, D]
        if scales is None:
            flat.index_copy_(0, slots, x)
        else:
            q, s = quantize_kv(x, values.dtype)
            raw(flat).index_copy_(0, slots, raw(q))
            scales.view(-1, x.shape[1]).index_copy_(0, slots, s)


def _context(cache: LayerKV, block_table: torch.Tensor, total: int, dtype: torch.dtype):
    """The first `total` tokens of a request's K and V, as [1, KVH, total, D] in `dtype`
    (a quantized cache's in float32: see paged_attention)."""
    out = []
    for values, scales in ((cache.k, cache.k_scales), (cache.v, cache.v_scales)):
        x = gather(values, block_table)[:total]  # [total, KVH, D]
        if scales is not None:
            x = dequantize_kv(x, gather(scales, block_table)[:total], dtype)
        out.append(x.transpose(0, 1).unsqueeze(0))
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    decode_attention,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (this step's, already written to the cache).

    `decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scales,
    v_scales)` runs the decodes (an op of pagoda.ops). A prefill chunk with no earlier
    context attends to this step's k/v as computed; one with context reads the cache.
    With a quantized cache every chunk reads it: attention then sees the same K/V
    however a request was scheduled (chunked, preempted and recomputed, cached), as
    decodes do. Returns [T, H, D].
    """
    nd = meta.num_decodes
    decode_args = (
        meta.decode_block_tables,
        meta.decode_seq_lens,
        scale,
        cache.k_scales,
        cache.v_scales,
    )
    if nd == q.shape[0]:  # a decode-only step: no copy
        return decode_attention(q, cache.k, cache.v, *decode_args)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(q[:nd], cache.k, cache.v, *decode_args)
    for start, qlen, ctx, block_table in zip(
        meta.prefill_query_starts,
        meta.prefill_query_lens,
        meta.prefill_context_lens,
        meta.prefill_block_tables,
        strict=True,
    ):
        # 4-D inputs: SDPA's CPU flash kernel (3-D ones fall back to the slow math path).
        qi = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if ctx == 0 and not cache.quantized:
            ki = k[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            vi = v[start : start + qlen].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            total = ctx + qlen
            # A quantized cache is attended in float32, as the decode kernel reads it: its
            # values are already rounded once; rounding them again to bf16 costs accuracy.
            dtype = torch.float32 if cache.quantized else q.dtype
            ki, vi = _context(cache, block_table, total, dtype)  # [1, KVH, ctx+L, D]
            # Query i sits at position ctx + i and sees keys 0 .. ctx + i.
            mask = torch.ones(qlen, total, dtype=torch.bool, device=q.device).tril(ctx)
            o = F.scaled_dot_product_attention(
                qi.to(dtype), ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            ).to(q.dtype)
        out[start : start + qlen] = o.squeeze(0).transpose(0, 1)
    return out
