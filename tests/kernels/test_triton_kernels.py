"""The Triton kernels (pagoda/ops/triton_ops.py) against their PyTorch twins, on small
shapes. Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set here
before the kernels are defined), so every commit tests them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagoda.ops import torch_ops, triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _paged_cache(lens, block_size, kv_heads, head_dim, dtype, seed):
    """Caches with the sequences' blocks scattered over a pool (holes between them,
    garbage in unused entries) and the block tables that find them."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = 3 * len(lens) * max_blocks + 5
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), max_blocks), 10**6, dtype=torch.int32)  # past the pool
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // block_size)
        tables[b, :need] = free[used : used + need].int()
        used += need
    return k_cache, v_cache, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size, head_dim, heads, kv_heads",
    [(16, 64, 4, 4), (16, 128, 6, 2), (32, 64, 8, 1), (32, 128, 3, 1), (16, 64, 16, 1)],
    ids=["gqa1-bs16-d64", "gqa3-bs16-d128", "gqa8-bs32-d64", "gqa3-bs32-d128", "gqa16-dot"],
)
def test_decode_attention(dtype, block_size, head_dim, heads, kv_heads):
    lens = [1, block_size, 3 * block_size + 5, 37]  # ragged, on and off block edges
    k_cache, v_cache, tables = _paged_cache(lens, block_size, kv_heads, head_dim, dtype, 0)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    safe_tables = tables.clamp(max=k_cache.shape[0] - 1)  # the twin gathers every entry
    want = torch_ops.decode_attention(q, k_cache, v_cache, safe_tables, seq_lens, scale)
    on = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, seq_lens)]
    # A split per block, uneven splits with some past a row's end, one split a row.
    for min_blocks in (1, 3, triton_ops.MIN_BLOCKS_PER_SPLIT):
        got = triton_ops.decode_attention(*on, scale, min_blocks_per_split=min_blocks)
        torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])


def naive_attention(q, keys, values, positions, key_positions, scale, window=0, softcap=0.0):
    """The obviously correct twin: q [L, H, D] at `positions` against keys/values [S,
    KVH, D] at `key_positions`, float32, causal, windowed, soft-capped."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, L, S]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    seen = key_positions[None, :] <= positions[:, None]
    if window:
        seen &= key_positions[None, :] > positions[:, None] - window
    s = s.masked_fill(~seen, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)  # [L, H, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(20, 0.0), (0, 5.0), (37, 3.0)])
def test_decode_attention_window_and_softcap(dtype, window, softcap):
    """A sliding window (shorter than some rows, longer than others, off block edges)
    and soft-capped logits: the Triton kernel and the PyTorch twin against the naive
    float32 attention."""
    block_size, heads, kv_heads, head_dim = 16, 6, 2, 64
    lens = [1, 19, 20, 21, 3 * block_size + 5, 150]
    k_cache, v_cache, tables = _paged_cache(lens, block_size, kv_heads, head_dim, dtype, 3)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    safe_tables = tables.clamp(max=k_cache.shape[0] - 1)
    want = torch.stack([
        naive_attention(
            q[b : b + 1], k_cache[safe_tables[b].long()].flatten(0, 1)[:n],
            v_cache[safe_tables[b].long()].flatten(0, 1)[:n], torch.tensor([n - 1]),
            torch.arange(n), 0.125, window, softcap,
        )[0]
        for b, n in enumerate(lens)
    ])  # fmt: skip
    twin = torch_ops.decode_attention(
        q, k_cache, v_cache, safe_tables, seq_lens, 0.125, window=window, softcap=softcap
    )
    torch.testing.assert_close(twin.float(), want, **TOL[dtype])
    on = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, seq_lens)]
    for min_blocks in (1, triton_ops.MIN_BLOCKS_PER_SPLIT):
        got = triton_ops.decode_attention(
            *on, 0.125, window=window, softcap=softcap, min_blocks_per_split=min_blocks
        )
        torch.testing.assert_close(got.cpu().float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_in_the_latent_space(dtype):
    """MLA's decode: one latent row a token (32 latent + 16 rope dims) as the only key
    head, its first 32 dims as the value, 8 query heads: the Triton kernel, the C++
    kernel and the twin against the naive attention."""
    from pagoda.ops import cpu

    lora, rope, heads, block_size = 32, 16, 8, 16
    lens = [1, 17, 3 * block_size + 5, 70]
    cache, _, tables = _paged_cache(lens, block_size, 1, lora + rope, dtype, 5)
    q = torch.randn(len(lens), heads, lora + rope).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    safe_tables = tables.clamp(max=cache.shape[0] - 1)
    want = torch.stack([
        naive_attention(
            q[b : b + 1], cache[safe_tables[b].long()].flatten(0, 1)[:n],
            cache[safe_tables[b].long()].flatten(0, 1)[:n, :, :lora], torch.tensor([n - 1]),
            torch.arange(n), 0.1,
        )[0]
        for b, n in enumerate(lens)
    ])  # fmt: skip
    twin = torch_ops.decode_attention(q, cache, cache, safe_tables, seq_lens, 0.1, v_dim=lora)
    torch.testing.assert_close(twin.float(), want, **TOL[dtype])
    module = cpu.load()
    if module is not None:
        got = module.paged_decode_attention(
            q, cache, cache, safe_tables.long(), seq_lens.long(), 0.1, v_dim=lora
        )
        torch.testing.assert_close(got.float(), want, **TOL[dtype])
    on = [t.to(DEVICE) for t in (q, cache, cache, tables, seq_lens)]
    got = triton_ops.decode_attention(*on, 0.1, v_dim=lora, min_blocks_per_split=1)
    assert got.shape == (len(lens), heads, lora)
    torch.testing.assert_close(got.cpu().float(), want, **TOL[dtype])


@pytest.mark.parametrize("window, softcap", [(20, 0.0), (0, 5.0), (9, 3.0)])
def test_prefill_attention_window_and_softcap(window, softcap):
    block_size, heads, kv_heads, head_dim = 16, 4, 2, 64
    chunks = [(0, 45), (block_size + 3, 30), (50, 1), (0, 7)]
    lens = [ctx + qlen for ctx, qlen in chunks]
    k_cache, v_cache, tables = _paged_cache(lens, block_size, kv_heads, head_dim, torch.float32, 4)
    qlens = [qlen for _, qlen in chunks]
    starts = [sum(qlens[:i]) for i in range(len(qlens))]
    q = torch.randn(sum(qlens), heads, head_dim)
    want = torch.cat([
        naive_attention(
            q[start : start + qlen], k_cache[table.long()].flatten(0, 1)[: ctx + qlen],
            v_cache[table.long()].flatten(0, 1)[: ctx + qlen], torch.arange(ctx, ctx + qlen),
            torch.arange(ctx + qlen), 0.125, window, softcap,
        )
        for (ctx, qlen), start, table in zip(chunks, starts, tables.clamp(max=k_cache.shape[0] - 1), strict=True)
    ])  # fmt: skip
    meta = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (starts, qlens)]
    ctxs = torch.tensor([c for c, _ in chunks], dtype=torch.int32, device=DEVICE)
    got = triton_ops.prefill_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), *meta, ctxs, tables.to(DEVICE),
        0.125, window=window, softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])


def test_decode_splits_are_each_rows_own():
    """A row's result is the same bits alone as in a batch with a wider table (what a
    CUDA graph replays: padded rows, the full table width), and a row past
    MAX_SPLITS x min_blocks gets longer splits, not more."""
    block_size, lens = 16, [3, 40, 131 * 16 + 3]
    k_cache, v_cache, tables = _paged_cache(lens, block_size, 2, 64, torch.float32, 2)
    q = torch.randn(len(lens), 4, 64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    on = [t.to(DEVICE) for t in (q, k_cache, v_cache)]
    args = dict(scale=0.125, min_blocks_per_split=1)
    batch = triton_ops.decode_attention(*on, tables.to(DEVICE), seq_lens.to(DEVICE), **args)
    safe_tables = tables.clamp(max=k_cache.shape[0] - 1)
    want = torch_ops.decode_attention(q, k_cache, v_cache, safe_tables, seq_lens, 0.125)
    torch.testing.assert_close(batch.cpu(), want, **TOL[torch.float32])
    for i, n in enumerate(lens):
        table = tables[i : i + 1, : -(-n // block_size)].to(DEVICE)
        alone = triton_ops.decode_attention(
            on[0][i : i + 1], *on[1:], table, seq_lens[i : i + 1].to(DEVICE), **args
        )
        assert torch.equal(alone, batch[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size, head_dim, heads, kv_heads",
    [(16, 64, 4, 4), (32, 128, 6, 2), (16, 64, 8, 1)],
    ids=["gqa1-bs16-d64", "gqa3-bs32-d128", "gqa8-bs16-d64"],
)
def test_prefill_attention(dtype, block_size, head_dim, heads, kv_heads):
    # (context already cached, chunk length): fresh prompts, a chunk after a cached
    # prefix, chunks longer than one query block, a one-token chunk.
    chunks = [(0, 5), (block_size + 3, 20), (0, 37), (2 * block_size, 1)]
    lens = [ctx + qlen for ctx, qlen in chunks]
    k_cache, v_cache, tables = _paged_cache(lens, block_size, kv_heads, head_dim, dtype, 1)
    qlens = [qlen for _, qlen in chunks]
    starts = [sum(qlens[:i]) for i in range(len(qlens))]
    q = torch.randn(sum(qlens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    want = torch.empty_like(q)
    for (ctx, qlen), start, table in zip(chunks, starts, tables, strict=True):
        blocks = table[: -(-(ctx + qlen) // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[: ctx + qlen]
        values = v_cache[blocks].flatten(0, 1)[: ctx + qlen]
        mask = torch.ones(qlen, ctx + qlen, dtype=torch.bool).tril(ctx)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start : start + qlen].transpose(0, 1).unsqueeze(0).float(),
            keys.transpose(0, 1).unsqueeze(0).float(),
            values.transpose(0, 1).unsqueeze(0).float(),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        want[start : start + qlen] = o.squeeze(0).transpose(0, 1).to(dtype)
    meta = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (starts, qlens)]
    ctxs = torch.tensor([c for c, _ in chunks], dtype=torch.int32, device=DEVICE)
    got = triton_ops.prefill_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), *meta, ctxs, tables.to(DEVICE), scale
    )
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_add_rms_norm(dtype, gemma):
    """Llama's norm, and Gemma's: a float32 (1 + w) weight, rounded after it."""
    x = torch.randn(5, 96).to(dtype)
    residual = torch.randn(5, 96).to(dtype)
    weight = (1 + 0.1 * torch.randn(96)).to(torch.float32 if gemma else dtype)
    want_x, want_r = torch_ops.add_rms_norm(x, residual, weight, 1e-5)
    got_x, got_r = triton_ops.add_rms_norm(
        x.clone().to(DEVICE), residual.clone().to(DEVICE), weight.to(DEVICE), 1e-5
    )
    # To a bf16 unit in the last place: the interpreter's float32 -> bf16 conversion
    # truncates where a GPU rounds to nearest.
    torch.testing.assert_close(got_r.cpu(), want_r, **TOL[dtype])
    torch.testing.assert_close(got_x.cpu(), want_x, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (96, 96), (128, 96)])
def test_rotary_embedding(dtype, head_dim, rotary_dim):
    """Whole heads, and partial rotary (Phi-4-mini's 96 of 128: the rest passes)."""
    T, heads, max_pos = 7, 5, 64
    qk = torch.randn(T, heads, head_dim).to(dtype)
    positions = torch.tensor([0, 3, 63, 10, 11, 12, 1])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    want = torch_ops.rotary_embedding(qk, positions, cos, sin)
    got = triton_ops.rotary_embedding(
        qk.clone().to(DEVICE), positions.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)
    )
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    assert torch.equal(want[..., rotary_dim:], qk[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = torch.randn(4, 2 * 1100).to(dtype)  # 1100: two column blocks, the last ragged
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = triton_ops.silu_and_mul(x.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 2, 64
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(4, kv_heads, head_dim).to(dtype)
    v = torch.randn(4, kv_heads, head_dim).to(dtype)
    slots = torch.tensor([5 * 16 + 3, 0, -1, 2 * 16 + 15])  # -1: padding, written nowhere
    kc, vc = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    triton_ops.write_kv(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k.view(-1, kv_heads, head_dim)[slot] = k[i]
            want_v.view(-1, kv_heads, head_dim)[slot] = v[i]
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


# ---- the whole engine on the Triton backend ---------------------------------------------


def test_engine_on_the_triton_backend_matches_the_torch_one(tiny_llama):
    """kernel_backend "triton" (the GPU's: Triton attention over the paged cache, its
    norm and rotary kernels) gives the PyTorch backend's tokens, greedy and seeded in
    float32, through chunked prefill, decode, prefix-cache hits (the seeded run's
    prompts are the greedy run's) and preemption. Here on the CPU in Triton's
    interpreter; on a GPU the same test runs there."""
    from transformers import AutoTokenizer

    from pagoda import LLM, SamplingParams
    from tests.helpers import tiny_prompts

    prompts = tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), n=5, seed=2)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, n=2, seed=5, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        # 24 blocks of 16 tokens: the prompts preempt; 64-token steps chunk them.
        llm = LLM(
            tiny_llama, dtype="float32", kernel_backend=backend, device=DEVICE,
            kv_cache_memory_bytes=24 * 8192, max_num_batched_tokens=64, enforce_eager=True,
        )  # fmt: skip
        inputs = [{"prompt_token_ids": p} for p in prompts]
        runs = [llm.generate(inputs, params, use_tqdm=False) for params in (greedy, seeded)]
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.kv_cache.prefix_cache_hits > 0
        outputs[backend] = [[[c.token_ids for c in o.outputs] for o in run] for run in runs]
    assert outputs["triton"] == outputs["torch"]


def test_windowed_softcapped_family_on_the_triton_backend(tmp_path):
    """Gemma 2 (sliding windows on every other layer, soft-capped logits, Gemma's norms)
    on the Triton backend: the PyTorch backend's tokens past three windows, chunked."""
    from transformers import AutoTokenizer

    from pagoda import LLM, SamplingParams
    from tests.helpers import make_model, tiny_prompts

    folder = make_model(str(tmp_path / "gemma2"), "gemma2")
    prompts = [(p * 90)[:90] for p in tiny_prompts(AutoTokenizer.from_pretrained(folder), 3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            folder, dtype="float32", kernel_backend=backend, device=DEVICE,
            kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=64, enforce_eager=True,
        )  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run on the GPU itself")
def test_kernels_compile_for_a_hopper_gpu():
    """Every kernel through Triton's compiler and ptxas for sm_90 (tests/
    compile_triton_kernels.py, in a process without the interpreter): what the
    interpreter lets through and a GPU would not fails here, on every commit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # a GPU's default; silences Triton's notice
    script = os.path.join(os.path.dirname(__file__), "compile_triton_kernels.py")
    done = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 60, done.stdout
