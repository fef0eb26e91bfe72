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
from pagoda.ops.torch_ops import gather_blocks


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]; slots: [T]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_attention,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (this step's, already written to the cache).

    `decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)` runs the
    decodes (an op of pagoda.ops). Returns [T, H, D].
    """
    nd = meta.num_decodes
    if nd == q.shape[0]:  # a decode-only step: no copy
        return decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale
        )
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale
        )
    for start, qlen, ctx, block_table in zip(
        meta.prefill_query_starts,
        meta.prefill_query_lens,
        meta.prefill_context_lens,
        meta.prefill_block_tables,
        strict=True,
    ):
        # 4-D inputs: SDPA's CPU flash kernel (3-D ones fall back to the slow math path).
        qi = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if ctx == 0:
            ki = k[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            vi = v[start : start + qlen].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            total = ctx + qlen
            ki = gather_blocks(k_cache, block_table)[:total].transpose(0, 1).unsqueeze(0)
            vi = gather_blocks(v_cache, block_table)[:total].transpose(0, 1).unsqueeze(0)
            # Query i sits at position ctx + i and sees keys 0 .. ctx + i.
            mask = torch.ones(qlen, total, dtype=torch.bool, device=q.device).tril(ctx)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start : start + qlen] = o.squeeze(0).transpose(0, 1)
    return out
