"""Every attention path against the obviously-correct one: dense causal attention
over each request's whole sequence, computed per request in float64."""

from __future__ import annotations

import pytest
import torch

from pagoda.attention.context import (
    AttentionMetadata,
    forward_context,
    get_attention_metadata,
    get_lora_mapping,
)
from pagoda.attention.kv_cache import PagedKVCache, dequantize_kv, quantize_kv
from pagoda.attention.paged import AttentionParams, paged_attention, write_kv
from pagoda.ops import cpu, select_ops


def dense_reference(q, k, v, scale, window=0, softcap=0.0):
    """q [L, H, D] against k/v [S, KVH, D], causal with the query at the end; a query
    sees its `window` latest keys (0: all); logits soft-capped (0: not)."""
    H, KVH = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // KVH, dim=1).double()
    v = v.repeat_interleave(H // KVH, dim=1).double()
    L, S = q.shape[0], k.shape[0]
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    if window:
        mask &= ~torch.ones(L, S, dtype=torch.bool).tril(S - L - window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def build_batch(
    seq_lens, query_lens, block_size=4, H=6, KVH=2, D=16, dtype=torch.float32, seed=0, kv_dtype=None
):
    """Random K/V for each whole sequence written into a shuffled paged cache (in `dtype`,
    or quantized to `kv_dtype`). Returns (q, per-sequence (k, v) as the cache holds them,
    block tables, the cache, per-sequence (k, v) as computed, before the cache)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    cache = PagedKVCache(1, num_blocks, block_size, KVH, D, kv_dtype or dtype).layer(0)
    free = torch.randperm(num_blocks, generator=g).tolist()
    seqs, fresh, tables = [], [], []
    for s in seq_lens:
        table = [free.pop() for _ in range(-(-s // block_size))]
        k = torch.randn(s, KVH, D, generator=g).to(dtype)
        v = torch.randn(s, KVH, D, generator=g).to(dtype)
        k[0, 0] *= 50  # an outlier: it sets its row's scale
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(s)]
        )
        write_kv(k, v, cache, slots)
        fresh.append((k, v))
        if cache.quantized:  # what the cache holds, for the reference
            k = dequantize_kv(*quantize_kv(k, cache.k.dtype), torch.float64)
            v = dequantize_kv(*quantize_kv(v, cache.v.dtype), torch.float64)
        seqs.append((k, v))
        tables.append(table)
    q = [torch.randn(ql, H, D, generator=g).to(dtype) for ql in query_lens]
    return q, seqs, tables, cache, fresh


KV_DTYPES = [None, torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["model-dtype", "int8", "fp8"])
@pytest.mark.parametrize(
    "window, softcap", [(0, 0.0), (5, 0.0), (0, 2.0)], ids=["full", "window", "softcap"]
)
def test_mixed_batch_matches_dense(dtype, tol, backend, kv_dtype, window, softcap):
    """A quantized cache is checked against the dense reference on what it holds (the
    rounding of K/V is the cache's, not the kernel's). A 5-token window over 4-token
    blocks starts mid-block; soft-capped logits take the explicit softmax."""
    if backend == "cpu" and cpu.load() is None:
        pytest.skip("no C++ toolchain")
    kernel = select_ops(backend, dtype).decode_attention
    # Three decodes (one has a single token of context), then prefills with and without context.
    seq_lens = [1, 9, 17, 6, 11, 8]
    query_lens = [1, 1, 1, 6, 3, 8]
    q, seqs, tables, cache, fresh = build_batch(
        seq_lens, query_lens, dtype=dtype, kv_dtype=kv_dtype
    )
    nd = 3
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    starts = torch.tensor([0] + query_lens).cumsum(0).tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decodes=nd,
        decode_block_tables=padded[:nd],
        decode_seq_lens=torch.tensor(seq_lens[:nd]),
        prefill_query_starts=starts[nd:-1],
        prefill_query_lens=query_lens[nd:],
        prefill_context_lens=[s - ql for s, ql in zip(seq_lens[nd:], query_lens[nd:], strict=True)],
        prefill_block_tables=[torch.tensor(t) for t in tables[nd:]],
    )
    q_flat = torch.cat(q)
    k_new = torch.cat(
        [k[s - ql :] for (k, _), s, ql in zip(fresh, seq_lens, query_lens, strict=True)]
    )
    v_new = torch.cat(
        [v[s - ql :] for (_, v), s, ql in zip(fresh, seq_lens, query_lens, strict=True)]
    )
    scale = 16**-0.5
    params = AttentionParams(scale, window, softcap)
    out = paged_attention(q_flat, k_new, v_new, cache, meta, params, kernel)
    for i, ((k, v), qi) in enumerate(zip(seqs, q, strict=True)):
        if query_lens[i] == seq_lens[i] > 1 and not cache.quantized:
            k, v = fresh[i]  # a prefill with no context: k/v as computed
        ref = dense_reference(qi, k, v, scale, window, softcap)
        got = out[starts[i] : starts[i + 1]].double()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["model-dtype", "int8", "fp8"])
def test_kernel_handles_long_contexts_and_head_dims(dtype, tol, block_size, kv_dtype):
    """Head dims 64 and 128 take the compiled fast paths (bf16: AVX512-BF16 dot
    products, 16 keys per reduction, partial chunks masked); 24 the generic one."""
    module = cpu.load()
    if module is None:
        pytest.skip("no C++ toolchain")
    for D, H, KVH in ((64, 9, 3), (128, 4, 4), (24, 4, 2), (256, 4, 1)):
        # 1100 and 1600 tokens: several chunks of about 512, combined (flash-decoding)
        seq_lens = [1, 33, 200, 47] if D != 64 else [1, 1100, 513, 1600]
        q, seqs, tables, cache, _ = build_batch(
            seq_lens, [1] * 4, block_size=block_size, H=H, KVH=KVH, D=D, dtype=dtype, seed=D,
            kv_dtype=kv_dtype,
        )  # fmt: skip
        max_blocks = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
        # A window off the chunk and block edges: it starts the first chunk late.
        for window in (0, 601 if D == 64 else 37):
            out = module.paged_decode_attention(
                torch.cat(q), cache.k, cache.v, padded, torch.tensor(seq_lens), D**-0.5,
                cache.k_scales, cache.v_scales, window,
            )  # fmt: skip
            for i, ((k, v), qi) in enumerate(zip(seqs, q, strict=True)):
                want = dense_reference(qi, k, v, D**-0.5, window)
                torch.testing.assert_close(out[i : i + 1].double(), want, atol=tol, rtol=tol)


def test_kernel_rows_are_independent_of_the_batch():
    """A row's output is bitwise the same alone or beside others, short or long (its
    context's split into chunks follows its own length): speculative verification
    and the decode loop rely on it."""
    module = cpu.load()
    if module is None:
        pytest.skip("no C++ toolchain")
    seq_lens = [1300, 5, 700, 64, 1]
    q, _, tables, cache, _ = build_batch(
        seq_lens, [1] * 5, block_size=16, H=9, KVH=3, D=64, dtype=torch.bfloat16, seed=3
    )
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    lens = torch.tensor(seq_lens)
    together = module.paged_decode_attention(torch.cat(q), cache.k, cache.v, padded, lens, 0.125)
    for i in range(len(seq_lens)):
        alone = module.paged_decode_attention(
            q[i], cache.k, cache.v, padded[i : i + 1], lens[i : i + 1], 0.125
        )
        assert torch.equal(alone, together[i : i + 1])


def test_forward_context_is_per_thread():
    """Two engines stepping on two threads of one process: each step's layers read
    their own thread's batch, whatever the other thread entered meanwhile."""
    import contextlib
    import threading

    both_inside = threading.Barrier(2)
    seen: dict[int, tuple] = {}

    def step(i: int) -> None:
        meta = AttentionMetadata(
            torch.arange(i + 1), i, torch.zeros(0, 1), torch.zeros(0), [], [], [], []
        )
        with forward_context(meta, lora=f"mapping {i}"):
            both_inside.wait()  # the other thread has entered its own context by now
            seen[i] = (get_attention_metadata(), get_lora_mapping())
            both_inside.wait()
        with contextlib.suppress(RuntimeError):  # once out, nothing is left behind
            seen[i] += (get_attention_metadata(),)

    threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(seen[0]), len(seen[1])] == [2, 2]
    assert [(meta.num_decodes, lora) for meta, lora in (seen[0], seen[1])] == [
        (0, "mapping 0"),
        (1, "mapping 1"),
    ]
