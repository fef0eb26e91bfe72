"""The quantized-weight kernels against their references, in float64.

- Repacking: GGUF blocks made by the `gguf` package's own quantizer (random raw
  super-blocks for Q4_K, Q5_K and Q6_K, which it cannot make) come back, through the PyTorch
  twin's dequantize, exactly as the package dequantizes them; every other GGUF type
  (Q2_K, Q3_K, i-quants) within its stated rounding; fused parts of different
  formats stack exactly (K-quants apart, each in its own format).
- dequantize (C++) equals the PyTorch twin bit for bit, in float32 and bf16.
- quant_linear (int8 activations, AVX512-VNNI) equals the same arithmetic done in
  float64: activations quantized per block of 32 exactly as llama.cpp's q8_1, then the
  dot products of the integers, scaled. Random and adversarial blocks (all zero, the
  largest magnitudes, one outlier), odd sizes (a tail of blocks that does not fill a
  64-byte load, odd row counts), 1 to 8 activation rows, bias, bf16 and float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagoda.model_executor.quantization import (
    FORMATS,
    K_QUANTS,
    OFFSETS,
    QuantizedWeight,
    from_gguf,
)
from pagoda.ops import TORCH_OPS, cpu
from tests.helpers import random_blocks

GGUF = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
        "q4_1": GGMLQuantizationType.Q4_1, "q5_0": GGMLQuantizationType.Q5_0,
        "q5_1": GGMLQuantizationType.Q5_1, "q4_k": GGMLQuantizationType.Q4_K,
        "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K,
        "q8_0+m": GGMLQuantizationType.Q5_1}  # q8_0 codes with minimums (Q5_1 widened)  # fmt: skip
KERNEL_CASES = (*FORMATS, "q8_0+m")


def columns(fmt: str, blocks: int) -> int:
    """K for a weight of about `blocks` blocks of 32: whole super-blocks for K-quants."""
    return 256 * -(-blocks // 8) if fmt in K_QUANTS else 32 * blocks


def make_weight(fmt: str, n: int, k: int, seed: int, adversarial: bool = False):
    """(QuantizedWeight, float64 dense values) from gguf's own quantizer, or for the
    K-quants from random raw super-blocks (the package cannot quantize to them)."""
    if fmt in K_QUANTS:
        raw = random_blocks(GGUF[fmt].name, n, k, seed=seed)  # (row 0 starts with zeros)
        if adversarial:  # row 1: the largest scales, and a super-block's d at fp16's top
            raw = raw.reshape(n, -1, {"q4_k": 144, "q5_k": 176, "q6_k": 210}[fmt])
            if fmt != "q6_k":
                raw[1, 0, 4:16] = 0xFF  # every 6-bit scale and minimum 63
            else:
                raw[1, 0, 192:208] = np.array([127, 128] * 8, dtype=np.uint8)  # 127, -128
                raw[1, 0, 208:210] = np.array([60000.0], dtype=np.float16).view(np.uint8)
            raw = raw.reshape(n, -1)
        qw = from_gguf(GGUF[fmt].name, raw)
        return qw, gguf_dequantize(raw, GGUF[fmt]).astype(np.float64)
    g = np.random.default_rng(seed)
    w = g.standard_normal((n, k)).astype(np.float32) * 0.05
    if adversarial:
        w[0] = 0.0  # a row of all-zero blocks (scale 0)
        w[1, :32] = 60000.0  # the largest fp16-scale magnitudes
        w[1, 32:64] = -60000.0
        w[2, 5] = 40.0  # one outlier in a block of small values
    raw = gguf_quantize(w, GGUF[fmt])
    if adversarial and fmt == "q8_0":  # codes at int8's two ends, -128 and 127
        raw[3, 2:34] = np.array([128, 127] * 16, dtype=np.uint8)
    qw = from_gguf(GGUF[fmt].name, raw)
    if fmt == "q8_0+m":
        qw = qw.widened()
    return qw, gguf_dequantize(raw, GGUF[fmt]).astype(np.float64)


def kernels_or_skip():
    module = cpu.load()
    if module is None:
        pytest.skip("no C++ toolchain")
    return module


@pytest.mark.parametrize("fmt", KERNEL_CASES)
def test_repacked_blocks_dequantize_as_gguf_does(fmt):
    k = columns(fmt, 3)
    qw, dense = make_weight(fmt, 7, k, seed=1, adversarial=True)
    assert qw.shape == (7, k) and qw.format == fmt.removesuffix("+m")
    assert (qw.m is not None) == (fmt in ("q4_1", "q5_1", "q8_0+m", "q4_k", "q5_k"))
    assert (qw.qh is not None) == (fmt.startswith("q5") or fmt == "q6_k")
    assert (qw.sc is not None) == (fmt in K_QUANTS)
    # Bytes per 32 weights: as in the file, but q4_k's and q5_k's 6-bit scales and minimums
    # unpacked.
    size = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0+m": 36,
            "q4_k": 18.5, "q5_k": 22.5, "q6_k": 26.25}[fmt]  # fmt: skip
    assert qw.nbytes == size * 7 * k // 32
    got = TORCH_OPS.dequantize(qw, torch.float32).double().numpy()
    np.testing.assert_array_equal(got, dense)


@pytest.mark.parametrize(
    "type_name,fmt",
    [("Q5_0", "q5_0"), ("Q5_1", "q5_1"), ("Q4_K", "q4_k"), ("Q5_K", "q5_k"), ("Q6_K", "q6_k"),
     ("Q3_K", "q8_0"), ("Q2_K", "q8_0"), ("IQ4_XS", "q8_0")],
)  # fmt: skip
def test_every_gguf_type_loads_into_blocks(type_name, fmt):
    """5-bit blocks and the K-quants Q4_K, Q5_K and Q6_K are kept exactly; other types
    are requantized to q8_0, within about half its step."""
    raw = random_blocks(type_name, 6, 512, seed=8)
    ref = gguf_dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    qw = from_gguf(type_name, raw)
    assert qw.format == fmt and qw.shape == (6, 512)
    got = TORCH_OPS.dequantize(qw, torch.float32).double().numpy()
    err = np.abs(got - ref).reshape(6, 16, 32)
    d = qw.d.double().numpy()[:, :, None]
    if fmt != "q8_0":
        np.testing.assert_array_equal(got, ref)
    else:
        # Half a step, plus what rounding the step to fp16 costs the largest code.
        assert (err <= (0.5 + 127 * 2.0**-11) * np.abs(d) + 1e-12).all()
    assert got[0, :32].tolist() == ref[0, :32].tolist()


def test_fused_parts_of_different_formats_stack_exactly():
    cases = [fmt for fmt in KERNEL_CASES if fmt not in K_QUANTS]
    parts = [make_weight(fmt, 5 + i, 256, seed=20 + i) for i, fmt in enumerate(cases)]
    fused = QuantizedWeight.cat([qw for qw, _ in parts])
    rows = sum(5 + i for i in range(len(cases)))
    assert fused.format == "q8_0" and fused.m is not None and fused.qh is None
    assert fused.shape == (rows, 256)
    got = TORCH_OPS.dequantize(fused, torch.float32).double().numpy()
    np.testing.assert_array_equal(got, np.concatenate([dense for _, dense in parts]))


def test_fused_k_quants_stack_as_their_format_or_apart():
    """A Q4_K_M file's q and k fuse as q4_k, exactly; with its Q6_K v they stay apart,
    each in its format (a StackedWeight), and the products run per piece: the CPU
    kernels give each piece's output as alone, and the PyTorch twin the stacked
    matrix's product."""
    (q, dq), (k, dk), (v, dv) = (make_weight(f, 6, 512, seed=30 + i) for i, f in
                                 enumerate(("q4_k", "q4_k", "q6_k")))  # fmt: skip
    same = QuantizedWeight.cat([q, k])
    assert same.format == "q4_k" and same.shape == (12, 512)
    np.testing.assert_array_equal(same.dequantized().double().numpy(), np.concatenate([dq, dk]))
    stack = QuantizedWeight.cat([q, k, v])
    assert stack.format == "q4_k+q6_k" and stack.shape == (18, 512)  # (q and k as one)
    assert stack.nbytes == q.nbytes + k.nbytes + v.nbytes
    np.testing.assert_array_equal(stack.dequantized().numpy(), np.concatenate([dq, dk, dv]))
    x, bias = torch.randn(3, 512), torch.randn(18)
    want = x.double() @ torch.from_numpy(np.concatenate([dq, dk, dv])).T + bias.double()
    got = TORCH_OPS.quant_linear(x, stack, bias).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    if cpu.load() is not None:
        ops = cpu.cpu_ops(torch.float32)
        # The blocks' kernels, and (past their rows) dequantized for a GEMM.
        for rows in (3, cpu.quant_linear_max_rows(torch.float32) + 1):
            xr = torch.randn(rows, 512)
            alone = [ops.quant_linear(xr, same, bias[:12]), ops.quant_linear(xr, v, bias[12:])]
            stacked = ops.quant_linear(xr, stack, bias)
            assert torch.equal(stacked, torch.cat(alone, -1))
            exact = xr.double() @ torch.from_numpy(np.concatenate([dq, dk, dv])).T + bias.double()
            assert (stacked.double() - exact).norm() / exact.norm() < 0.02  # int8 activations
        assert torch.equal(ops.dequantize(stack, torch.float32), stack.dequantized())


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_columns_whole_super_blocks_or_in_blocks_of_32(fmt):
    """A tensor-parallel cut on super-blocks keeps the format exactly; one inside them
    gives the weight in 32-weight blocks: q4_k/q5_k's codes with each 32's scale and
    minimum rounded to fp16 (q4_1/q5_1), q6_k requantized to q8_0."""
    qw, dense = make_weight(fmt, 6, 1024, seed=40)
    whole = qw.columns(256, 768)
    assert whole.format == fmt and whole.shape == (6, 512)
    np.testing.assert_array_equal(whole.dequantized().double().numpy(), dense[:, 256:768])
    cut = qw.columns(128, 896)  # Llama-2-7B's 11,008 at two ranks cuts at 5,504 = 21.5 x 256
    assert cut.format == {"q4_k": "q4_1", "q5_k": "q5_1", "q6_k": "q8_0"}[fmt]
    assert cut.shape == (6, 768)
    want = dense[:, 128:896].reshape(6, 24, 32)
    err = np.abs(cut.dequantized().double().numpy().reshape(6, 24, 32) - want)
    d = cut.d.double().numpy()[:, :, None]
    if fmt == "q6_k":  # half an 8-bit step, plus the step's own fp16 rounding
        assert (err <= (0.5 + 127 * 2.0**-11) * np.abs(d) + 1e-9).all()
    else:  # d * code and the minimum, each within fp16's rounding
        m = cut.m.double().numpy()[:, :, None]
        assert (err <= 2.0**-11 * (np.abs(want) + 2 * np.abs(m)) * 1.01 + 1e-12).all()
    assert err.max() > 0  # (the rounding is real)


@pytest.mark.parametrize("fmt", KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_dequantize_equals_the_twin(fmt, dtype):
    module = kernels_or_skip()
    qw, _ = make_weight(fmt, 37, columns(fmt, 19), seed=2, adversarial=True)
    want = TORCH_OPS.dequantize(qw, dtype)
    got = module.dequantize(qw.qs, qw.d, qw.m, qw.format_code, dtype, qh=qw.qh, sc=qw.sc)
    assert got.dtype == dtype and torch.equal(got, want)


def quantize_activations(x: torch.Tensor):
    """llama.cpp's q8_1 in float32, as the kernel does it: per block of 32,
    d = max|x| / 127, q = round(x / d) (ties to even)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = torch.round(blocks * inv.unsqueeze(-1))
    return q.double(), d.double()


def reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in float64: sum_b d_w d_a sum(q_w q_a) + (m_w - off d_w) s_a
    (K-quants: the quantized activations times the weights, as the twin dequantizes them)."""
    qa, da = quantize_activations(x)  # [M, nb, 32], [M, nb]
    if qw.format in K_QUANTS:
        y = (qa * da.unsqueeze(-1)).reshape(x.shape) @ qw.dequantized().double().T
        return y if bias is None else y + bias.double()
    qwv = qw.codes()  # [N, nb, 32] (checked against gguf's dequantization above)
    dw = qw.d.double()
    mw = qw.m.double() if qw.m is not None else torch.zeros_like(dw)
    dots = torch.einsum("mbj,nbj->mnb", qa, qwv.double())
    sa = da * qa.sum(-1)  # [M, nb]
    y = (dots * dw.unsqueeze(0) * da.unsqueeze(1)).sum(-1)
    y = y + (sa.unsqueeze(1) * (mw - OFFSETS[qw.format] * dw).unsqueeze(0)).sum(-1)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("fmt", KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11])
def test_quant_linear_equals_float64(fmt, dtype, rows):
    module = kernels_or_skip()
    if not module.quant_linear_available():
        pytest.skip("no int8 dot products (AVX512-VNNI or AVX2)")
    for n, nb, seed in ((37, 18, 3), (64, 48, 4), (5, 1, 5), (11, 7, 6)):
        k = columns(fmt, nb)
        nb = k // 32
        qw, dense = make_weight(fmt, n, k, seed=seed, adversarial=n > 3)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, k, generator=g).to(dtype)
        x[0, :32] = 0.0  # a block of zero activations
        if rows > 1:
            x[1, 32 : min(64, 32 * nb)] *= 1000.0  # a loud block
        bias = torch.randn(n, generator=g).to(dtype)
        for b in (None, bias):
            got = module.quant_linear(x, qw.qs, qw.d, qw.m, qw.format_code, b, qh=qw.qh, sc=qw.sc)
            assert got.shape == (rows, n) and got.dtype == dtype
            want = reference(x, qw, b)
            scale = want.abs().max().item() + 1.0
            tol = 2**-7 if dtype == torch.bfloat16 else 1e-5  # the output's rounding
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)
            # And the unquantized product, within what rounding each activation to its
            # block's int8 grid can cost: sum over blocks of d_a / 2 * sum |w|.
            exact = x.double() @ torch.from_numpy(dense).T + (0 if b is None else b.double())
            _, da = quantize_activations(x)
            w_abs = torch.from_numpy(np.abs(dense)).reshape(n, nb, 32).sum(-1)  # [N, nb]
            bound = (da / 2) @ w_abs.T
            assert ((got.double() - exact).abs() <= bound * 1.001 + tol * scale).all()


@pytest.mark.parametrize("fmt", KERNEL_CASES)
def test_quant_linear_rows_are_independent(fmt):
    """Each row's result is bitwise the same whatever else is in the call: speculative
    decoding verifies drafts as extra rows and must get what decoding one by one gets."""
    module = kernels_or_skip()
    if not module.quant_linear_available():
        pytest.skip("no int8 dot products (AVX512-VNNI or AVX2)")
    k = columns(fmt, 9)
    qw, _ = make_weight(fmt, 40, k, seed=8, adversarial=True)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(8)).bfloat16()

    def run(rows: torch.Tensor) -> torch.Tensor:
        return module.quant_linear(
            rows, qw.qs, qw.d, qw.m, qw.format_code, None, qh=qw.qh, sc=qw.sc
        )

    one_by_one = torch.cat([run(x[i : i + 1]) for i in range(16)])
    for rows in (2, 5, 8, 13, 16):
        got = run(x[:rows])
        assert torch.equal(got, one_by_one[:rows])


@pytest.mark.parametrize("fmt", KERNEL_CASES)
def test_ops_quant_linear_both_regimes(fmt):
    """The CPU backend: int8 dot products up to 8 rows, dequantize + GEMM past them; the
    PyTorch twin always dequantizes. All within quantization error of float64."""
    if cpu.load() is None:
        pytest.skip("no C++ toolchain")
    k = columns(fmt, 6)
    qw, dense = make_weight(fmt, 96, k, seed=7)
    for ops in (cpu.cpu_ops(torch.bfloat16), cpu.cpu_ops(torch.bfloat16, False), TORCH_OPS):
        for rows in (1, 8, 9, 40):
            x = torch.randn(rows, k).bfloat16()
            got = ops.quant_linear(x, qw, None).double()
            exact = x.double() @ torch.from_numpy(dense).T
            assert got.shape == (rows, 96)
            assert (got - exact).norm() / exact.norm() < 0.03


@pytest.mark.parametrize(
    "fmt, n, keeps_blocks",
    [("q4_0", 1024, True), ("q4_k", 1024, True), ("q6_k", 1024, False), ("q4_0", 1016, False)],
)
def test_large_4bit_weights_keep_their_blocks_at_every_row_count(fmt, n, keeps_blocks):
    """In float32, a q4_0/q4_1/q4_k weight of 2^21 elements or more runs on its blocks
    past QUANT_LINEAR_MAX_ROWS_FLOAT32 too (each row bitwise what it gives alone); other
    formats, and smaller weights, dequantize for the GEMM there. Both within
    quantization error of float64."""
    module = kernels_or_skip()
    if not module.quant_linear_available():
        pytest.skip("no int8 dot products (AVX512-VNNI or AVX2)")
    k = 2048  # (n = 1024: 2^21 elements)
    qw, dense = make_weight(fmt, n, k, seed=5)
    ops = cpu.cpu_ops(torch.float32)
    x = torch.randn(cpu.QUANT_LINEAR_MAX_ROWS_FLOAT32 + 1, k)
    got = ops.quant_linear(x, qw, None)
    assert torch.equal(got[:3], ops.quant_linear(x[:3], qw, None)) == keeps_blocks
    exact = x.double() @ torch.from_numpy(dense).T
    assert (got.double() - exact).norm() / exact.norm() < 0.03


# ---- w8a8: int8 weights per channel, activations per row --------------------------------


def w8a8_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None):
    """The kernels' arithmetic in float64: s_x = max|x| / 127 per row, q_x = round(x / s_x)
    (ties to even), y = s_x s_w (q_x @ q_w^T) + bias."""
    xf = x.double()
    sx = xf.abs().amax(1, keepdim=True) / 127.0
    qx = torch.round(xf / torch.where(sx > 0, sx, 1.0))
    y = (qx @ qw.qs.double().T) * sx * qw.d.double().unsqueeze(0)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 42])  # dot products, then the integer GEMM
def test_w8a8_linear_equals_float64(dtype, rows):
    from pagoda.model_executor.quantization import quantize_per_channel

    module = kernels_or_skip()
    run = module.int8_linear_small if rows <= cpu.INT8_SMALL_MAX_ROWS else module.int8_linear_large
    if run is module.int8_linear_small and not module.int8_linear_small_available():
        pytest.skip("no AVX512-VNNI")
    g = torch.Generator().manual_seed(rows)
    # k = 100: a tail shorter than a 64-byte load; k = 102: rows of K not whole 4-byte words
    # (AVX2's GEMM packs weights in words of 4, 8 x 8 of them at a time where whole); k =
    # 16,384: its blocks of rows (about 256 KB of them: 16 rows there) more than one.
    for n, k in ((37, 576), (70, 100), (5, 64), (19, 102), (19, 16384)):
        w = torch.randn(n, k, generator=g) * 0.05
        w[0] = 0.0  # a zero row: scale 0
        w[1, 3] = 4.0  # an outlier in a row
        qw = quantize_per_channel(w)
        assert qw.shape == (n, k) and qw.qs.dtype == torch.int8 and qw.d.shape == (n,)
        x = torch.randn(rows, k, generator=g).to(dtype)
        x[0] = 0.0  # a zero activation row
        if rows > 1:
            x[1, 7] = 300.0  # a loud channel
        bias = torch.randn(n, generator=g).to(dtype)
        # |q| of 128 against |x| of 127, a pair of them: at vpmaddubsw's int16 limit, not past it.
        qw.qs[2, 4:6] = -128
        x[:, 4:6] = x.float().abs().amax(1, keepdim=True).to(dtype)
        for b in (None, bias):
            got = run(x.contiguous(), qw.qs, qw.d, b)
            assert got.shape == (rows, n) and got.dtype == dtype
            if module.int8_linear_small_available():  # exact integer sums: equal bit for bit
                other = (
                    module.int8_linear_large
                    if run is module.int8_linear_small
                    else module.int8_linear_small
                )
                assert torch.equal(got, other(x.contiguous(), qw.qs, qw.d, b))
            want = w8a8_reference(x, qw, b)
            tol = 2**-7 if dtype == torch.bfloat16 else 1e-5  # the output's rounding
            scale = want.abs().max().item() + 1.0
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


def test_w8a8_through_the_ops_in_every_regime(monkeypatch):
    """cpu ops: VNNI (<= 8 rows), integer GEMM (<= 256, or every row count on a CPU
    without AMX), dequantize + bf16 GEMM past that (AMX's limit, set here on any CPU),
    and float activations: all within quantization error of the float product."""
    from pagoda.model_executor.quantization import quantize_per_channel

    if cpu.load() is None:
        pytest.skip("no C++ toolchain")
    w = torch.randn(96, 192) * 0.05
    qw = quantize_per_channel(w)
    dense = TORCH_OPS.dequantize(qw, torch.float64)
    np.testing.assert_allclose(dense.numpy(), w.double().numpy(), atol=qw.d.max().item() / 2 + 1e-9)
    this_cpu = cpu.cpu_ops(torch.bfloat16)
    monkeypatch.setattr(cpu, "W8A8_INT_MAX_ROWS", 256)  # as on AMX: bf16 past 256 rows
    amx_limit = cpu.cpu_ops(torch.bfloat16)
    for ops in (this_cpu, amx_limit, cpu.cpu_ops(torch.bfloat16, False), TORCH_OPS):
        for rows in (1, 8, 9, 256, 300):
            x = torch.randn(rows, 192).bfloat16()
            got = ops.quant_linear(x, qw, None).double()
            exact = x.double() @ dense.T
            assert got.shape == (rows, 96)
            assert (got - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_cpp_dequantize_equals_the_twin(dtype):
    from pagoda.model_executor.quantization import quantize_per_channel

    if cpu.load() is None:
        pytest.skip("no C++ toolchain")
    qw = quantize_per_channel(torch.randn(37, 100) * 0.05)  # 100: a tail of 4 lanes
    got = cpu.cpu_ops(torch.bfloat16).dequantize(qw, dtype)
    assert got.dtype == dtype and torch.equal(got, TORCH_OPS.dequantize(qw, dtype))
