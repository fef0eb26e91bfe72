"""Triton kernels for the GPU backend, each the twin of a PyTorch reference in
`torch_ops` (tests/kernels/test_triton_kernels.py checks every one on small shapes; without
a GPU they run under TRITON_INTERPRET=1, so CI tests them on every commit).

    primitive          kernel
    prefill_attention  varlen causal attention of prefill chunks over their paged
                       context: a program per (chunk, head, 16 queries), online softmax
                       over the blocks up to its last query's position
    decode_attention   split-KV (flash-decoding): a program per (sequence, KV head,
                       split of the context) reads its blocks through the block table
                       once for all the query heads of that KV head (GQA), keeps an
                       online softmax, and writes a partial (max, sum, acc); a second
                       kernel merges the splits. A few long sequences still give the
                       GPU B x KVH x splits programs.
    add_rms_norm       residual += x; x = RMSNorm(residual) * w: one program per row
    rotary_embedding   rotate-half, in place, q and k heads together
    silu_and_mul       silu(gate) * up of a fused [T, 2I] projection
    write_kv           K and V of the step's tokens into their cache slots

Shapes and layouts are the CPU path's: caches [num_blocks, block_size, KVH, D],
block tables [B, max_blocks] int32, slots `block * block_size + offset`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- decode attention --------------------------------------------------------------


def _precision(cache_dtype: torch.dtype) -> str:
    """tl.dot's: float32 models exactly ("ieee"; a GPU's default, TF32, rounds operands
    to 10 bits), half-precision ones on tensor cores (TF32 keeps their 7 or 10 bits)."""
    return "ieee" if cache_dtype == torch.float32 else "tf32"


# A row's context is cut into at most MAX_SPLITS pieces of at least `min_blocks`
# blocks each, by its own length alone: a step's other rows, its table width and
# CUDA-graph padding change nothing (replays and eager steps sum in the same order).
MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4
# MLA's latent decode holds [16, 512] float32 accumulators: 8 warps keep them in
# registers (4 spill, per ptxas for sm_90). (Tested here and compiled for sm_90; the
# GPU path itself refuses DeepSeek until its MoE runs there.)
LATENT_NUM_WARPS = 8


def _check_shapes(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    """The attention kernels' tiles: whole GQA groups, powers of 2 of at least 16."""
    if heads % kv_heads or any(n < 16 or n & (n - 1) for n in (head_dim, block_size)):
        raise ValueError(
            f"heads {heads}/{kv_heads}, head_dim {head_dim}, block_size {block_size}: "
            "the Triton attention needs whole groups, and powers of 2 of at least 16"
        )


def group_pad(group: int) -> int:
    """A KV head's query heads, padded to tl.dot's 16 rows at least: the decode's dot
    products run on tensor cores, with a [16, D] accumulator instead of a [group,
    block, D] product (which spills registers from group 8 on)."""
    return max(16, triton.next_power_of_2(group))


@triton.jit
def _row_splits(seq_len, window, min_blocks, BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """(the row's first block its window reaches, its blocks, blocks per split, its
    splits): the blocks from the first one on split evenly."""
    blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0) // BLOCK_SIZE, 0)
    span = blocks - first
    per_split = tl.maximum(min_blocks, (span + MAX_SPLITS - 1) // MAX_SPLITS)
    return first, blocks, per_split, (span + per_split - 1) // per_split


@triton.jit
def _softcap(s, softcap):
    """softcap * tanh(s / softcap), tanh from exp (Triton's core has none)."""
    x = s / softcap
    t = tl.exp(-2.0 * tl.abs(x))
    return softcap * tl.where(x < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t)


@triton.jit(
    do_not_specialize=["scale", "window", "softcap", "min_blocks", "num_splits", "stride_tb"]
)
def _decode_partial(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr,  # inputs
    m_ptr, l_ptr, acc_ptr,  # partial results [B, H, S] and [B, H, S, D]
    scale, window, softcap, min_blocks, num_splits,  # run-time: no compile per table width
    stride_tb, stride_kn, stride_kb, stride_kh,
    H: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, R: tl.constexpr = 0,
):  # fmt: skip
    # R > 0: MLA's latent rows, keys of D + R dims (the latent, then the rope key) whose
    # first D serve as the values; q rows are D + R wide, the output D.
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    lo, blocks, per_split, _ = _row_splits(seq_len, window, min_blocks, BLOCK_SIZE, MAX_SPLITS)
    first = lo + split * per_split
    oldest = tl.where(window > 0, seq_len - window, 0)  # the first key the query sees
    count = tl.minimum(per_split, blocks - first)  # <= 0: a split past the row's end
    heads = kvh * GROUP + tl.arange(0, GROUP_PAD)  # this KV head's query heads
    head_ok = tl.arange(0, GROUP_PAD) < tl.where(count > 0, GROUP, 0)
    d = tl.arange(0, D)
    q_rows = (b * H + heads)[:, None] * (D + R)
    q = tl.load(q_ptr + q_rows + d[None, :], mask=head_ok[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    if R > 0:
        r = D + tl.arange(0, R)
        q_rope = tl.load(q_ptr + q_rows + r[None, :], mask=head_ok[:, None], other=0.0)
        q_rope = q_rope.to(tl.float32) * scale
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741 (the softmax's sum, as in the papers)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    t = tl.arange(0, BLOCK_SIZE)
    for i in range(count):
        logical = first + i
        pos = logical * BLOCK_SIZE + t
        ok = (pos < seq_len) & (pos >= oldest)
        block = tl.load(tables_ptr + b * stride_tb + logical)
        offs = (
            block.to(tl.int64) * stride_kn + kvh * stride_kh + t[:, None] * stride_kb + d[None, :]
        )
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if R > 0:
            rope_offs = block.to(tl.int64) * stride_kn + kvh * stride_kh + t[:, None] * stride_kb
            k_rope = tl.load(k_ptr + rope_offs + r[None, :], mask=ok[:, None], other=0.0)
            s += tl.dot(q_rope, tl.trans(k_rope.to(tl.float32)), input_precision=PRECISION)
        if SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a block before the window
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = (b * H + heads) * num_splits + split
    tl.store(m_ptr + out, m, mask=head_ok)  # (a split past the end writes nothing)
    tl.store(l_ptr + out, l, mask=head_ok)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=head_ok[:, None])


@triton.jit(do_not_specialize=["window", "min_blocks", "num_splits"])
def _decode_merge(
    m_ptr, l_ptr, acc_ptr, o_ptr, lens_ptr, window, min_blocks, num_splits,
    H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # b * H + h
    seq_len = tl.load(lens_ptr + row // H)
    _, _, _, splits = _row_splits(seq_len, window, min_blocks, BLOCK_SIZE, MAX_SPLITS)
    s = tl.arange(0, MAX_SPLITS)
    valid = s < splits  # the row's own splits: each saw at least one key
    m = tl.load(m_ptr + row * num_splits + s, mask=valid, other=float("-inf"))
    l = tl.load(l_ptr + row * num_splits + s, mask=valid, other=0.0)  # noqa: E741
    w = tl.where(valid, tl.exp(m - tl.max(m, 0)), 0.0)
    d = tl.arange(0, D)
    acc = tl.load(
        acc_ptr + (row * num_splits + s)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0
    )
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o_ptr + row * D + d, o.to(o_ptr.dtype.element_ty))


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
    min_blocks_per_split: int = MIN_BLOCKS_PER_SPLIT,
) -> torch.Tensor:
    """`torch_ops.decode_attention`: q [B, H, D], caches [N, bs, KVH, D], block_tables
    [B, MB], seq_lens [B] (each >= 1) -> [B, H, Dv]. Each row's context (its window's
    blocks) runs in up to MAX_SPLITS parallel pieces of at least `min_blocks_per_split`
    blocks. `v_dim` > 0: MLA's latent rows (values: their first v_dim dims)."""
    if k_scales is not None or v_scales is not None:
        raise NotImplementedError("decode_attention (Triton): quantized KV caches")
    B, H, width = q.shape
    _, block_size, KVH, _ = k_cache.shape
    D = v_dim or width  # the values' dims (and the first part of the keys')
    R = width - D  # the keys' rope dims beyond them (MLA)
    _check_shapes(H, KVH, D, block_size)
    if R:
        _check_shapes(H, KVH, R, block_size)
    # The grid's splits: enough for a row as wide as the table.
    num_splits = min(MAX_SPLITS, triton.cdiv(block_tables.shape[1], min_blocks_per_split))
    group = H // KVH
    m = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)  # noqa: E741
    acc = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    _decode_partial[(B, KVH, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, m, l, acc, scale, window, softcap or 1.0,
        min_blocks_per_split, num_splits,
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=H, GROUP=group, GROUP_PAD=group_pad(group), D=D,
        BLOCK_SIZE=block_size, MAX_SPLITS=MAX_SPLITS, PRECISION=_precision(k_cache.dtype),
        SOFTCAP=bool(softcap), R=R, num_warps=LATENT_NUM_WARPS if R else 4,
    )  # fmt: skip
    out = q.new_empty(B, H, D)
    _decode_merge[(B * H,)](
        m, l, acc, out, seq_lens, window, min_blocks_per_split, num_splits,
        H=H, D=D, BLOCK_SIZE=block_size, MAX_SPLITS=MAX_SPLITS,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["scale", "window", "softcap", "stride_tb"])
def _prefill_attention(
    q_ptr, k_ptr, v_ptr, o_ptr, starts_ptr, qlens_ptr, ctx_ptr, tables_ptr,
    scale, window, softcap,
    stride_tb, stride_kn, stride_kb, stride_kh,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    chunk, h, mblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    qlen = tl.load(qlens_ptr + chunk)
    if mblock * BLOCK_M < qlen:
        start = tl.load(starts_ptr + chunk).to(tl.int64)
        ctx = tl.load(ctx_ptr + chunk)
        kvh = h // GROUP
        rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)  # query i of the chunk
        row_ok = rows < qlen
        d = tl.arange(0, D)
        q_offs = ((start + rows) * H + h)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Query i sits at position ctx + i and sees keys 0 .. ctx + i (with a window,
        # ctx + i - window + 1 .. ctx + i).
        last = ctx + tl.minimum(qlen, (mblock + 1) * BLOCK_M) - 1
        oldest = tl.where(window > 0, tl.maximum(ctx + mblock * BLOCK_M - window + 1, 0), 0)
        t = tl.arange(0, BLOCK_SIZE)
        for logical in range(oldest // BLOCK_SIZE, tl.cdiv(last + 1, BLOCK_SIZE)):
            block = tl.load(tables_ptr + chunk * stride_tb + logical)
            pos = logical * BLOCK_SIZE + t
            key_ok = pos <= last
            offs = (
                block.to(tl.int64) * stride_kn
                + kvh * stride_kh
                + t[:, None] * stride_kb
                + d[None, :]
            )
            k = tl.load(k_ptr + offs, mask=key_ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=key_ok[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if SOFTCAP:
                s = _softcap(s, softcap)
            visible = (pos[None, :] <= (ctx + rows)[:, None]) & key_ok[None, :]
            if window > 0:
                visible &= pos[None, :] > (ctx + rows)[:, None] - window
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows past qlen see nothing
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)  # noqa: E741
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(o_ptr + q_offs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Prefill chunks over their paged context, causal, varlen: chunk c's queries are
    q[query_starts[c] : + query_lens[c]] [.., H, D], at positions context_lens[c] + i,
    each seeing its request's keys up to its own position (this step's K/V already
    written to the caches [N, bs, KVH, D]; block_tables [C, MB]). `max_query_len`:
    the longest chunk, if the caller knows it (else read off the device: a sync);
    `window`, `softcap`: as `decode_attention`'s. Returns [T, H, D] (rows of no chunk
    untouched: uninitialized)."""
    T, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    _check_shapes(H, KVH, D, block_size)
    block_m = 16
    max_qlen = max_query_len
    if max_qlen is None:
        max_qlen = int(query_lens.max()) if len(query_lens) else 0
    out = torch.empty_like(q)
    if max_qlen == 0:
        return out
    q = q.contiguous()
    grid = (len(query_lens), H, triton.cdiv(max_qlen, block_m))
    _prefill_attention[grid](
        q, k_cache, v_cache, out, query_starts, query_lens, context_lens, block_tables, scale,
        window, softcap or 1.0,
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=H, GROUP=H // KVH, D=D, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        PRECISION=_precision(k_cache.dtype), SOFTCAP=bool(softcap),
    )  # fmt: skip
    return out


def paged_attention(q, k, v, cache, meta, params) -> torch.Tensor:
    """The step's attention (the `attention` op): k, v [T, KVH, D] written to their
    slots, then decodes through `decode_attention` and prefill chunks through
    `prefill_attention`, both reading the paged cache (a `LayerKV`) through the
    block tables of `meta` (an `AttentionMetadata`), with the layer's scale, window
    and soft cap (`params`, an AttentionParams). q [T, H, D] -> [T, H, D]."""
    if cache.quantized:
        raise NotImplementedError("the Triton attention: quantized KV caches")
    write_kv(k.contiguous(), v.contiguous(), cache.k, cache.v, meta.slot_mapping)
    nd = meta.num_decodes
    decode_args = (cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens, params.scale)
    extra = dict(window=params.window, softcap=params.softcap)
    if nd == q.shape[0]:  # a decode-only step (what a CUDA graph replays)
        return decode_attention(q, *decode_args, **extra)
    out = prefill_attention(
        q, cache.k, cache.v, meta.prefill_starts, meta.prefill_lens, meta.prefill_contexts,
        meta.prefill_tables, params.scale, max(meta.prefill_query_lens), **extra,
    )  # fmt: skip
    if nd:
        out[:nd] = decode_attention(q[:nd], *decode_args, **extra)
    return out


# ---- the small per-layer ops ------------------------------------------------------------


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, n, eps, BLOCK: tl.constexpr, GEMMA: tl.constexpr):
    # Math in float32, rounded to the dtype where the twin's eager ops round (loads are
    # widened first: bf16 arithmetic is not the same in Triton's interpreter).
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * n + c, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * n + c, mask=ok, other=0.0).to(tl.float32)
    h = (x + r).to(dtype)  # `x + residual`
    tl.store(res_ptr + row * n + c, h, mask=ok)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, 0) / n + eps)
    normed = hf * inv
    if not GEMMA:  # Llama rounds before the weight; Gemma (a float32 1 + w) after it
        normed = normed.to(dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * n + c, (w * normed).to(dtype), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- RMSNorm(residual) * weight; returns both."""
    assert x.is_contiguous() and residual.is_contiguous()
    rows, n = x.shape
    gemma = weight.dtype == torch.float32 and x.dtype != torch.float32
    _add_rms_norm[(rows,)](
        x, residual, weight, n, eps, BLOCK=triton.next_power_of_2(n), GEMMA=gemma
    )
    return x, residual


@triton.jit
def _rotary(
    qk_ptr, pos_ptr, cos_ptr, sin_ptr, heads,
    D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    ok = i < HALF
    p = tl.load(pos_ptr + t).to(tl.int64)
    dtype = qk_ptr.dtype.element_ty
    c = tl.load(cos_ptr + p * HALF + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + p * HALF + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
    base = qk_ptr + (t * heads + h) * D  # dims 2 * HALF.. (partial rotary) stay
    x1 = tl.load(base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0).to(tl.float32)
    # Each product rounded to the dtype, then the sum: as the twin's eager ops do.
    a, b = (x1 * c).to(dtype).to(tl.float32), (x2 * s).to(dtype).to(tl.float32)
    d, e = (x2 * c).to(dtype).to(tl.float32), (x1 * s).to(dtype).to(tl.float32)
    tl.store(base + i, (a - b).to(dtype), mask=ok)
    tl.store(base + HALF + i, (d + e).to(dtype), mask=ok)


def rotary_embedding(
    qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """qk [T, heads, D] rotated at positions [T] (in place when contiguous, else in a
    contiguous copy: a view of the fused q/k/v product); cos/sin [max_pos, R/2], R <= D
    (partial rotary: dims R.. pass through)."""
    qk = qk.contiguous()
    T, heads, D = qk.shape
    half = cos.shape[1]
    _rotary[(T, heads)](
        qk, positions, cos, sin, heads, D=D, HALF=half, HALF_PAD=triton.next_power_of_2(half)
    )
    return qk


@triton.jit
def _silu_and_mul(x_ptr, o_ptr, inter, BLOCK: tl.constexpr):
    row, col = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = col * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    dtype = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * 2 * inter + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + c, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu rounds here
    tl.store(o_ptr + row * inter + c, (silu * up).to(dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, up) -> silu(gate) * up [T, I]."""
    assert x.is_contiguous()
    T, two_inter = x.shape
    inter = two_inter // 2
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul[(T, triton.cdiv(inter, block))](x, out, inter, BLOCK=block)
    return out


@triton.jit
def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # slot -1: a padding token, written nowhere
        i = tl.arange(0, ROW_PAD)
        ok = i < ROW
        tl.store(kc_ptr + slot * ROW + i, tl.load(k_ptr + t * ROW + i, mask=ok), mask=ok)
        tl.store(vc_ptr + slot * ROW + i, tl.load(v_ptr + t * ROW + i, mask=ok), mask=ok)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """k, v [T, KVH, D] into caches [N, bs, KVH, D] at slot_mapping [T] (-1: skip)."""
    assert k.is_contiguous() and v.is_contiguous() and k_cache.is_contiguous()
    row = k.shape[1] * k.shape[2]
    _write_kv[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, ROW=row, ROW_PAD=triton.next_power_of_2(row)
    )
