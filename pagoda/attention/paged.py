"""Paged attention over a flat batch: decodes through the kernel layer's
`decode_attention`, prefill chunks through PyTorch's SDPA.

Every query attends to its request's context, read through the block table,
plus the causally earlier tokens of its own chunk. Decodes are one batched
call; prefill chunks run one SDPA call each (a loop over requests, not
tokens), straight from the new K/V when there is no earlier context.

A sliding window limits query i (at position p) to keys p - window + 1 .. p: a
chunk reads only the blocks its window reaches, and long chunks run in query tiles
so that no tile computes scores its window excludes. Soft-capped logits (Gemma 2)
take an explicit softmax: SDPA has no cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention.context import AttentionMetadata
from pagoda.attention.kv_cache import LayerKV, dequantize_kv, gather, quantize_kv, raw


@dataclass(frozen=True)
class AttentionParams:
    """What a layer's attention computes besides q, k and v."""

    scale: float
    window: int = 0  # sliding window in tokens, the query's own included; 0: none
    softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap); 0: none


def write_kv(k: torch.Tensor, v: torch.Tensor | None, cache: LayerKV, slots: torch.Tensor) -> None:
    """This step's k, v [T, KVH, D] into the cache at `slots` [T] (quantized if it is).
    v None: a cache of one row a token (MLA's latent rows) takes k alone."""
    for x, values, scales in ((k, cache.k, cache.k_scales), (v, cache.v, cache.v_scales)):
        if x is None:
            continue
        flat = values.view(-1, *x.shape[1:])  # [num_blocks * block_size, KVH, D]
        if scales is None:
            flat.index_copy_(0, slots, x)
        else:
            q, s = quantize_kv(x, values.dtype)
            raw(flat).index_copy_(0, slots, raw(q))
            scales.view(-1, x.shape[1]).index_copy_(0, slots, s)


def _context(cache: LayerKV, block_table: torch.Tensor, start: int, end: int, dtype):
    """Tokens [start, end) of a request's K and V, as [1, KVH, end - start, D] in
    `dtype` (a quantized cache's in float32: see paged_attention). Reads only the
    blocks that hold them."""
    bs = cache.k.shape[1]
    first = start // bs
    table = block_table[first : -(-end // bs)]
    lo, hi = start - first * bs, end - first * bs
    out = []
    for values, scales in ((cache.k, cache.k_scales), (cache.v, cache.v_scales)):
        x = gather(values, table)[lo:hi]  # [end - start, KVH, D]
        if scales is not None:
            x = dequantize_kv(x, gather(scales, table)[lo:hi], dtype)
        out.append(x.transpose(0, 1).unsqueeze(0))
    return out


def attend(q, k, v, mask, params: AttentionParams, is_causal: bool = False) -> torch.Tensor:
    """q [1, H, L, D] against k, v [1, KVH, S, D] (GQA), `mask` [L, S] bool (True: sees)
    or None with `is_causal`; v's head size may be below q's (MLA). SDPA, or with a
    soft cap the explicit float32 softmax (HF's eager attention). Returns [1, H, L, Dv]
    in q's dtype."""
    if not params.softcap:
        dv = v.shape[-1]
        if dv < q.shape[-1]:  # MLA: SDPA's fused kernel wants one head size (3.5x faster)
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=params.scale, enable_gqa=True
        )
        return out[..., :dv]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * params.scale  # [1, H, L, S]
    scores = torch.tanh(scores / params.softcap) * params.softcap
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def visible(positions: torch.Tensor, key_start: int, num_keys: int, window: int) -> torch.Tensor:
    """[L, S] bool: key key_start + j is at or before query position p, and inside its window."""
    keys = torch.arange(key_start, key_start + num_keys, device=positions.device)
    seen = keys[None, :] <= positions[:, None]
    if window:
        seen &= keys[None, :] > positions[:, None] - window
    return seen


def _prefill_chunk(q, k, v, cache, block_table, ctx, params: AttentionParams) -> torch.Tensor:
    """One request's chunk: q [L, H, D] at positions ctx .. ctx + L - 1, its own k/v [L,
    KVH, D] (already in the cache) -> [L, H, D]."""
    qlen = q.shape[0]
    window = params.window if params.window < ctx + qlen else 0  # 0: it excludes nothing
    # Without a window one call does; else query tiles of `window` rows, each reading
    # the 2 * window - 1 keys it can see.
    tile = max(window, 64) if window else qlen
    out = torch.empty_like(q)
    for first in range(0, qlen, tile):
        rows = slice(first, min(first + tile, qlen))
        qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, l, D]
        p0, p1 = ctx + first, ctx + rows.stop  # the tile's positions [p0, p1)
        k_start = max(0, p0 - window + 1) if window else 0
        if k_start >= ctx and not cache.quantized:  # every key it sees is this chunk's own
            ki = k[k_start - ctx : p1 - ctx].transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
            vi = v[k_start - ctx : p1 - ctx].transpose(0, 1).unsqueeze(0)
            dtype = q.dtype
        else:
            # A quantized cache is attended in float32, as the decode kernel reads it: its
            # values are already rounded once; rounding them again to bf16 costs accuracy.
            dtype = torch.float32 if cache.quantized else q.dtype
            ki, vi = _context(cache, block_table, k_start, p1, dtype)  # [1, KVH, S, D]
        causal_only = not window and k_start == p0 and p1 - p0 == ki.shape[2]
        mask = None
        if not causal_only:
            positions = torch.arange(p0, p1, device=q.device)
            mask = visible(positions, k_start, ki.shape[2], window)
        o = attend(qi.to(dtype), ki, vi, mask, params, is_causal=causal_only)
        out[rows] = o.to(q.dtype).squeeze(0).transpose(0, 1)
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    params: AttentionParams,
    decode_attention,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (this step's, already written to the cache).

    `decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scales,
    v_scales, window, softcap)` runs the decodes (an op of pagoda.ops). A prefill chunk
    with no earlier context attends to this step's k/v as computed; one with context
    reads the cache. With a quantized cache every chunk reads it: attention then sees
    the same K/V however a request was scheduled (chunked, preempted and recomputed,
    cached), as decodes do. Returns [T, H, D].
    """
    nd = meta.num_decodes
    decode_args = (
        meta.decode_block_tables,
        meta.decode_seq_lens,
        params.scale,
        cache.k_scales,
        cache.v_scales,
        params.window,
        params.softcap,
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
        rows = slice(start, start + qlen)
        out[rows] = _prefill_chunk(q[rows], k[rows], v[rows], cache, block_table, ctx, params)
    return out


def batch_invariant_attention(
    decode_attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """The batch-invariant mode's attention (pagoda.ops.cpu): this step's K/V into the
    cache, then every query row, prefill rows too, through the decode kernel, as a
    decode at its own position. That kernel's sums are split by the row's position
    alone, so a token's attention is the same in a prefill chunk of any length, after
    a prefix hit, or decoded; a chunk of L rows reads its context L times (the price)."""
    write_kv(k, v, cache, meta.slot_mapping)
    tables, lens = meta.query_rows()
    return decode_attention(
        q, cache.k, cache.v, tables, lens, params.scale, cache.k_scales, cache.v_scales,
        params.window, params.softcap,
    )  # fmt: skip
