"""Every attention path against the obviously-correct one: dense causal attention
over each request's whole sequence, computed per request in float64."""

from __future__ import annotations

import pytest
import torch

from pagoda import cpu_kernels
from pagoda.attention.context import AttentionMetadata
from pagoda.attention.torch_paged import paged_attention, write_kv


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
    kernel = None
    if backend == "cpu":
        module = cpu_kernels.load()
        if module is None:
            pytest.skip("no C++ toolchain")
        kernel = module.paged_decode_attention
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
    module = cpu_kernels.load()
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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8])
def test_small_gemm_rounds_like_a_float32_accumulation(rows):
    """The small-M bf16 GEMM (decode linears) against float64: off only by the final
    bf16 rounding, as oneDNN is, for odd K (masked tail) and N (row tail), with bias."""
    module = cpu_kernels.load()
    if module is None or not module.small_gemm_available():
        pytest.skip("no C++ toolchain or no AVX512-BF16")
    g = torch.Generator().manual_seed(rows)
    for n, k in ((960, 576), (37, 70), (5, 1536)):
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16()
        for b in (None, bias):
            got = module.small_gemm(x, w, b)
            exact = torch.nn.functional.linear(
                x.double(), w.double(), None if b is None else b.double()
            )
            # bf16 keeps 8 significant bits: half a unit in the last place, relative.
            assert got.shape == (rows, n) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3)
            onednn = torch.nn.functional.linear(x, w, b)
            assert (got != onednn).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_rotary_match_the_pytorch_layers(dtype):
    """The C++ RMSNorm (plain and fused with the residual add) and rotary embedding
    against the PyTorch layers they replace. They round where those round, so bf16 is
    bit-exact; float32 may differ in the last bit of the norm's sum of squares."""
    from pagoda.model_executor.layers.layernorm import RMSNorm
    from pagoda.model_executor.layers.rotary import RotaryEmbedding

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("no C++ toolchain")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(37, 576, generator=g).to(dtype)
    want, want_residual = norm(x.clone(), residual.clone())
    want_plain = norm(x)
    got, got_residual = x.clone(), residual.clone()
    module.fused_add_rms_norm(got, got_residual, norm.weight, norm.eps)
    exact = dtype == torch.bfloat16
    tol = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 1e-5, "rtol": 1e-5}
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(module.rms_norm(x, norm.weight, norm.eps), want_plain, **tol)

    rotary = RotaryEmbedding(64, 4096, 10000.0).to(dtype)
    qkv = torch.randn(37, 15, 64, generator=g).to(dtype)
    qk = qkv[:, :12]  # a strided view, as the model passes it
    positions = torch.randint(0, 4096, (37,), generator=g)
    want = rotary(positions, qk.clone())
    module.rotary_embedding(qk, positions, rotary.cos, rotary.sin)
    assert torch.equal(qk, want)
    with pytest.raises(RuntimeError, match="position out of range"):
        module.rotary_embedding(qk, torch.full((37,), 4096), rotary.cos, rotary.sin)
