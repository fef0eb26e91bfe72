"""Every attention path against the obviously-correct one: dense causal attention
over each request's whole sequence, computed per request in float64."""

from __future__ import annotations

import pytest
import torch

from pagoda.attention.context import AttentionMetadata
from pagoda.attention.paged import paged_attention, write_kv
from pagoda.ops import cpu, select_ops


def dense_reference(q, k, v, scale):
    """q [L, H, D] against k/v [S, KVH, D], causal with the query at the end."""
    H, KVH = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // KVH, dim=1).double()
    v = v.repeat_interleave(H // KVH, dim=1).double()
    L, S = q.shape[0], k.shape[0]
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def build_batch(seq_lens, query_lens, block_size=4, H=6, KVH=2, D=16, dtype=torch.float32, seed=0):
    """Random K/V for each whole sequence written into a shuffled paged cache."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.zeros(num_blocks, block_size, KVH, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    seqs, tables = [], []
    for s in seq_lens:
        table = [free.pop() for _ in range(-(-s // block_size))]
        k = torch.randn(s, KVH, D, generator=g).to(dtype)
        v = torch.randn(s, KVH, D, generator=g).to(dtype)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(s)]
        )
        write_kv(k, v, k_cache, v_cache, slots)
        seqs.append((k, v))
        tables.append(table)
    q = [torch.randn(ql, H, D, generator=g).to(dtype) for ql in query_lens]
    return q, seqs, tables, k_cache, v_cache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batch_matches_dense(dtype, tol, backend):
    if backend == "cpu" and cpu.load() is None:
        pytest.skip("no C++ toolchain")
    kernel = select_ops(backend, dtype).decode_attention
    # Three decodes (one has a single token of context), then prefills with and without context.
    seq_lens = [1, 9, 17, 6, 11, 8]
    query_lens = [1, 1, 1, 6, 3, 8]
    q, seqs, tables, k_cache, v_cache = build_batch(seq_lens, query_lens, dtype=dtype)
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
        [k[s - ql :] for (k, _), s, ql in zip(seqs, seq_lens, query_lens, strict=True)]
    )
    v_new = torch.cat(
        [v[s - ql :] for (_, v), s, ql in zip(seqs, seq_lens, query_lens, strict=True)]
    )
    scale = 16**-0.5
    out = paged_attention(q_flat, k_new, v_new, k_cache, v_cache, meta, scale, kernel)
    for i, ((k, v), qi) in enumerate(zip(seqs, q, strict=True)):
        ref = dense_reference(qi, k, v, scale)
        got = out[starts[i] : starts[i + 1]].double()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_handles_long_contexts_and_head_dims(dtype, tol, block_size):
    """Head dims 64 and 128 take the compiled fast paths (bf16: AVX512-BF16 dot
    products, 16 keys per reduction, partial chunks masked); 24 the generic one."""
    module = cpu.load()
    if module is None:
        pytest.skip("no C++ toolchain")
    for D, H, KVH in ((64, 9, 3), (128, 4, 4), (24, 4, 2)):
        seq_lens = [1, 33, 200, 47]
        q, seqs, tables, k_cache, v_cache = build_batch(
            seq_lens, [1] * 4, block_size=block_size, H=H, KVH=KVH, D=D, dtype=dtype, seed=D
        )
        max_blocks = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
        out = module.paged_decode_attention(
            torch.cat(q), k_cache, v_cache, padded, torch.tensor(seq_lens), D**-0.5
        )
        for i, ((k, v), qi) in enumerate(zip(seqs, q, strict=True)):
            torch.testing.assert_close(
                out[i : i + 1].double(), dense_reference(qi, k, v, D**-0.5), atol=tol, rtol=tol
            )
