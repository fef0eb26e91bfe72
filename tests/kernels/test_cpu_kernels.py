"""The non-attention C++ kernels against the PyTorch code they replace: the small-M
bf16 GEMM (decode linears) and the fused RMSNorm and rotary embedding."""

from __future__ import annotations

import pytest
import torch

from pagoda.ops import cpu


def kernels_or_skip():
    module = cpu.load()
    if module is None:
        pytest.skip("no C++ toolchain")
    return module


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8])
def test_small_gemm_rounds_like_a_float32_accumulation(rows):
    """The small-M bf16 GEMM (decode linears) against float64: off only by the final
    bf16 rounding, as oneDNN is, for odd K (masked tail) and N (row tail), with bias."""
    module = kernels_or_skip()
    if not module.small_gemm_available():
        pytest.skip("no AVX512-BF16")
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_batch_invariant_products_give_a_row_what_it_gets_alone(dtype):
    """The batch-invariant mode's products (cpu_ops(batch_invariant=True)): each row of
    an M-row product, for M from 1 to 300 (past the row blocks of the large-M pass),
    is bitwise the row computed alone; the float32 small_gemm is a float32 product."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagoda.model_executor.quantization import from_gguf, quantize_per_channel

    module = kernels_or_skip()
    ops = cpu.cpu_ops(dtype, batch_invariant=True)
    if ops is None:
        pytest.skip("no AVX512-BF16")
    g = torch.Generator().manual_seed(1)
    n, k = 203, 160  # a row tail of N, and a K tail of the 32-wide steps
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g).to(dtype)
    weights = {
        "dense": w.to(dtype),
        "q4_1": from_gguf("Q4_1", quantize(w.numpy(), GGMLQuantizationType.Q4_1)),
        "q8_0": from_gguf("Q8_0", quantize(w.numpy(), GGMLQuantizationType.Q8_0)),
        "w8a8": quantize_per_channel(w),
    }
    x = torch.randn(300, k, generator=g).to(dtype)
    for name, weight in weights.items():
        product = ops.linear if name == "dense" else ops.quant_linear
        alone = torch.cat([product(x[i : i + 1], weight, bias) for i in range(len(x))])
        for m in (1, 2, 5, 8, 9, 16, 17, 64, 131, 300):
            got = product(x[:m], weight, bias)
            assert torch.equal(got, alone[:m]), f"{name} at {m} rows"
    exact = torch.nn.functional.linear(x.double(), w.to(dtype).double(), bias.double())
    torch.testing.assert_close(module.small_gemm(x, w.to(dtype), bias).double(), exact,
                               rtol=2**-8 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("rotary_dim", [64, 48], ids=["rotary", "partial-rotary"])
def test_fused_norm_and_rotary_match_the_pytorch_layers(dtype, gemma, rotary_dim):
    """The C++ RMSNorm (plain and fused with the residual add; Llama's, and Gemma's with
    its float32 1 + w weight) and rotary embedding (whole heads, and the first 48 of 64
    dims) against the PyTorch layers they replace. They round where those round, so
    bf16 is bit-exact; float32 may differ in the last bit of the norm's sum of squares."""
    from pagoda.model_executor.layers.layernorm import RMSNorm
    from pagoda.model_executor.layers.rotary import RotaryEmbedding

    module = kernels_or_skip()
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5, gemma=gemma)
    norm.weight.data = torch.randn(576, generator=g).to(torch.float32 if gemma else dtype)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(37, 576, generator=g).to(dtype)
    want, want_residual = norm(x.clone(), residual.clone())
    want_plain = norm(x)
    got, got_residual = x.clone(), residual.clone()
    module.fused_add_rms_norm(got, got_residual, norm.weight, norm.eps)
    # Llama's bf16 rounds x * rsqrt before the weight, which absorbs the last bit of the
    # sum of squares: exact. Gemma's rounds once, after the weight: a last-bit difference
    # in the sum may flip a rounding (one bf16 unit, rarely).
    exact = dtype == torch.bfloat16 and not gemma
    tol = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.bfloat16 and gemma:
        tol = {"atol": 1e-2, "rtol": 2**-7}
    assert torch.equal(got_residual, want_residual)
    plain = module.rms_norm(x, norm.weight, norm.eps)
    for have, expected in ((got, want), (plain, want_plain)):
        torch.testing.assert_close(have, expected, **tol)
        if dtype == torch.bfloat16:
            assert (have != expected).float().mean() < 1e-3

    params = {"rope_theta": 10000.0, "partial_rotary_factor": rotary_dim / 64}
    rotary = RotaryEmbedding(64, 4096, params, 4096).to(dtype)
    assert rotary.cos.shape == (4096, rotary_dim // 2)
    qkv = torch.randn(37, 15, 64, generator=g).to(dtype)
    qk = qkv[:, :12]  # a strided view, as the model passes it
    positions = torch.randint(0, 4096, (37,), generator=g)
    want = rotary(positions, qk.clone())
    module.rotary_embedding(qk, positions, rotary.cos, rotary.sin)
    assert torch.equal(qk, want)
    with pytest.raises(RuntimeError, match="position out of range"):
        module.rotary_embedding(qk, torch.full((37,), 4096), rotary.cos, rotary.sin)


def test_bf16_linear_pads_rows_to_a_few_shapes():
    """Past small_gemm's rows, the CPU backend's bf16 linear pads M to a bucket (oneDNN
    keeps a compiled kernel per distinct M); the rows kept are the product of x alone."""
    from pagoda.ops.cpu import bucket_rows, cpu_ops

    sizes = [bucket_rows(m) for m in range(1, 4097)]
    assert all(m <= b <= m * 1.125 + 7 for m, b in zip(range(1, 4097), sizes, strict=True))
    assert sizes == sorted(sizes) and len(set(sizes)) <= 60
    ops = cpu_ops(torch.bfloat16) if cpu.load() is not None else None
    if ops is None:
        pytest.skip("no C++ toolchain")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    for m in (9, 37, 100, 300):
        x = torch.randn(m, 64, generator=g).bfloat16()
        got = ops.linear(x, w, None)
        exact = torch.nn.functional.linear(x.double(), w.double())
        assert got.shape == (m, 96)
        torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-2)


def test_a_stale_build_lock_is_removed(tmp_path):
    """An interrupted first build leaves torch's lock behind; a later start must not
    wait on it forever, nor take a fresh one from a build still running."""
    import os
    import time

    from pagoda.ops.cpu import remove_stale_lock

    lock = tmp_path / "lock"
    assert not remove_stale_lock(str(tmp_path))  # none: nothing to do
    lock.write_text("")
    assert not remove_stale_lock(str(tmp_path)) and lock.exists()  # a build running now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert remove_stale_lock(str(tmp_path)) and not lock.exists()
