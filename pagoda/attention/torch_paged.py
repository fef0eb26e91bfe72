"""The reference paged attention backend, in pure PyTorch (also the CPU path).

Every query attends to its request's context, read through the block table,
plus the causally earlier tokens of its own chunk. Decodes are batched in one
SDPA call; prefill chunks run one SDPA call each (a loop over requests, not
tokens), straight from the new K/V when there is no earlier context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.context import AttentionMetadata


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


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, KVH, D], block_table [..., MB] -> [..., MB * bs, KVH, D]."""
    g = cache[block_table]
    return g.flatten(-4, -3)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel=None,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (this step's, already written to the cache).

    `decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale)`, when
    given, replaces the batched-SDPA decode (see pagoda.cpu_kernels). Returns [T, H, D].
    """
    nd = meta.num_decodes
    if decode_kernel is not None and nd == q.shape[0]:  # a decode-only step: no copy
        return decode_kernel(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale
        )
    out = torch.empty_like(q)
    if nd and decode_kernel is not None:
        out[:nd] = decode_kernel(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale
        )
    elif nd:
        # [nd, H, 1, D] against [nd, KVH, S, D], S = max_blocks * block_size.
        keys = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)
        values = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = (positions[None, :] < meta.decode_seq_lens[:, None])[:, None, None, :]  # [nd,1,1,S]
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[:nd] = o.squeeze(2)
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
            ki = (
                _gather(k_cache, block_table)[:total].transpose(0, 1).unsqueeze(0)
            )  # [1, KVH, ctx+L, D]
            vi = _gather(v_cache, block_table)[:total].transpose(0, 1).unsqueeze(0)
            # Query i sits at position ctx + i and sees keys 0 .. ctx + i.
            mask = torch.ones(qlen, total, dtype=torch.bool, device=q.device).tril(ctx)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
        o = o.squeeze(0)
        out[start : start + qlen] = o.transpose(0, 1)
    return out
