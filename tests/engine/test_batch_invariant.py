"""The batch-invariant mode (`batch_invariant=True`, pagoda.ops.cpu): each request's
tokens and logprobs are bitwise what it gets alone, whatever else is in the batch,
however its prompt is chunked, whether its prefix came from the cache, after a
preemption (recompute or swap), with speculative decoding, per weight format and KV
dtype, with adapters, and through the server from another process. Without the mode
bf16 results move with the batch (near-ties, logprobs in their last bits); in float32
the mode still matches transformers token for token."""

from __future__ import annotations

import asyncio
import functools
import random

import openai
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagoda import LLM, SamplingParams
from pagoda.lora.request import LoRARequest
from tests.helpers import (
    ADAPTERS,
    NGRAM,
    WINDOW,
    RemoteServer,
    hf_greedy,
    make_adapter,
    make_model,
)

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
BLOCK_BYTES_BF16 = 4096  # tiny llama: 2 layers x 2 x 16 tokens x 2 heads x 16 dims x 2 bytes


def shared_prefix_prompts(n: int, seed: int, vocab: int = 380) -> list[list[int]]:
    """n prompts of 1..90 tokens, most starting with part of one of 5 shared bases (so
    a batch of them hits the prefix cache at every length)."""
    rng = random.Random(seed)
    bases = [[rng.randrange(5, vocab) for _ in range(48)] for _ in range(5)]
    prompts = []
    for _ in range(n):
        head = bases[rng.randrange(5)][: rng.choice([0, 5, 16, 17, 33, 48])]
        prompts.append(head + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 42))])
    return prompts


def result(output) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """(tokens, each position's top logprobs): what must not move with the batch."""
    c = output.outputs[0]
    return list(c.token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]


def alone(llm: LLM, prompts, params=GREEDY, **kwargs) -> list:
    """Each prompt in a step of its own: the reference. (Every one runs its max_tokens,
    EOS ignored: a reference of nothing would make every comparison vacuous.)"""
    got = [result(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False, **kwargs)[0])
           for p in prompts]  # fmt: skip
    assert all(len(tokens) == len(top) == params.max_tokens for tokens, top in got)
    return got


def together(llm: LLM, prompts, params=GREEDY, **kwargs) -> list:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kwargs
    )
    return [result(o) for o in outs]


def engine(folder: str, **kwargs) -> LLM:
    defaults = dict(dtype="bfloat16", batch_invariant=True, kv_cache_memory_bytes=1 << 22)
    return LLM(folder, **{**defaults, **kwargs})


# ---- random batch mixes --------------------------------------------------------------------------

POOL = shared_prefix_prompts(40, seed=11)


@pytest.fixture(scope="module")
def mixes(tiny_llama):
    """(each pool prompt alone, an engine per (chunk budget, pool size, preemption mode)):
    the references once; engines as the examples ask for them."""
    reference = alone(engine(tiny_llama, enable_prefix_caching=False), POOL)

    @functools.cache
    def engine_for(budget: int, tight: bool, mode: str) -> LLM:
        # Tight: 24 blocks for up to 64 requests of up to 7 blocks each: preemptions.
        memory = 24 * BLOCK_BYTES_BF16 if tight else 1 << 22
        return engine(
            tiny_llama, max_num_batched_tokens=budget, kv_cache_memory_bytes=memory,
            preemption_mode=mode, swap_space=64 * BLOCK_BYTES_BF16, max_model_len=160,
        )  # fmt: skip

    return reference, engine_for


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    picks=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=64),
    budget=st.sampled_from([16, 40, 256]),
    tight=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    warm=st.booleans(),
)
def test_each_request_is_what_it_is_alone_in_any_mix(mixes, picks, budget, tight, mode, warm):
    reference, engine_for = mixes
    llm = engine_for(budget, tight, mode)
    if warm:  # some of the batch's prefixes come from the cache
        together(llm, [POOL[i] for i in picks[::3]])
    before = llm.llm_engine.get_stats().num_preemptions
    got = together(llm, [POOL[i] for i in picks])
    event(f"preempted: {llm.llm_engine.get_stats().num_preemptions > before}")
    for i, g in zip(picks, got, strict=True):
        assert g == reference[i], f"pool prompt {i} moved with the batch"


def test_preemption_recompute_and_swap_change_nothing(tiny_llama):
    prompts = POOL[:24]
    reference = alone(engine(tiny_llama), prompts)
    for mode in ("recompute", "swap"):
        llm = engine(tiny_llama, kv_cache_memory_bytes=16 * BLOCK_BYTES_BF16, max_model_len=160,
                     preemption_mode=mode, swap_space=64 * BLOCK_BYTES_BF16)  # fmt: skip
        assert together(llm, prompts) == reference
        assert llm.llm_engine.get_stats().num_preemptions > 0, mode


def test_prefixes_read_back_from_the_disk_tier(tiny_llama, tmp_path):
    prompts = POOL[:12]
    reference = alone(engine(tiny_llama, enable_prefix_caching=False), prompts)
    first = engine(tiny_llama, kv_offload_dir=str(tmp_path))
    assert together(first, prompts) == reference
    first.llm_engine.kv_tier.flush()
    first.llm_engine.shutdown()
    again = engine(tiny_llama, kv_offload_dir=str(tmp_path), max_num_batched_tokens=40)
    assert together(again, prompts) == reference
    assert again.llm_engine.get_stats().kv_cache.tier_hit_tokens > 0


# ---- every weight format and KV dtype ----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,quantization,kv_cache_dtype,int8_activations",
    [
        ("bfloat16", "auto", "auto", None),
        ("float32", "auto", "auto", None),
        ("bfloat16", "q4_0", "auto", None),
        ("bfloat16", "q4_1", "auto", None),
        ("bfloat16", "q5_0", "auto", None),
        ("bfloat16", "q5_1", "auto", None),
        ("bfloat16", "q8_0", "auto", None),
        ("float32", "q4_1", "auto", None),
        ("bfloat16", "q4_0", "auto", False),  # dequantized, then small_gemm
        ("bfloat16", "w8a8", "auto", None),
        ("bfloat16", "auto", "int8", None),
        ("bfloat16", "auto", "fp8_e4m3", None),
    ],
)  # fmt: skip
def test_every_weight_format_and_kv_dtype(tiny_llama, dtype, quantization, kv_cache_dtype,
                                          int8_activations):  # fmt: skip
    kwargs = dict(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                  int8_activations=int8_activations)  # fmt: skip
    prompts = POOL[:14]
    reference = alone(engine(tiny_llama, enable_prefix_caching=False, **kwargs), prompts)
    llm = engine(tiny_llama, max_num_batched_tokens=32, **kwargs)
    together(llm, prompts[:3])  # their prefixes cached
    assert together(llm, prompts) == reference


def test_float32_still_matches_transformers(tiny_llama):
    prompts = POOL[:8]
    llm = engine(tiny_llama, dtype="float32", max_num_batched_tokens=24)
    got = [tokens for tokens, _ in together(llm, prompts)]
    assert got == hf_greedy(tiny_llama, tuple(map(tuple, prompts)), MAX_TOKENS)


@pytest.mark.parametrize("arch", ["gemma2", "qwen3", "qwen2_moe", "mistral_window"])
def test_families_windows_softcaps_and_experts(tmp_path, arch):
    """Gemma 2's soft caps and local layers, Qwen3's q/k norms, experts whose row counts
    move with the batch, a window far shorter than the prompts."""
    folder = make_model(str(tmp_path / arch), arch)
    prompts = [p * 3 for p in POOL[:10]]  # up to 270 tokens: many windows long
    assert max(map(len, prompts)) > 3 * WINDOW
    reference = alone(engine(folder, enable_prefix_caching=False, max_model_len=320), prompts)
    llm = engine(folder, max_num_batched_tokens=48, max_model_len=320)
    together(llm, prompts[:2])
    assert together(llm, prompts) == reference


# ---- sampling, speculation, adapters -------------------------------------------------------------


def test_seeded_sampling_and_speculative_decoding(tiny_llama):
    prompts = [(p[:6] * 12)[:60] for p in POOL[:10]]  # repetitive: the n-grams draft
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=i,
                             logprobs=2, ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    plain = engine(tiny_llama, enable_prefix_caching=False)
    reference = alone(plain, prompts)
    sampled = [alone(plain, [p], s)[0] for p, s in zip(prompts, seeded, strict=True)]
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
    assert [result(o) for o in outs] == sampled
    draft = {"method": "draft", "model": tiny_llama, "quantization": "q8_0",
             "num_speculative_tokens": 3, "disable_by_batch_size": 64}  # fmt: skip
    for spec in (NGRAM, draft):
        llm = engine(tiny_llama, speculative_config=spec, max_num_batched_tokens=64)
        assert together(llm, prompts) == reference, spec["method"]
        stats = llm.llm_engine.get_stats().spec_decoding
        assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0


def test_adapters_in_a_mixed_batch(tiny_llama, tmp_path):
    names = ["all8", "mlp16"]
    loras = [LoRARequest(n, i, make_adapter(tiny_llama, str(tmp_path / n), seed=i, **ADAPTERS[n]))
             for i, n in enumerate(names, 1)]  # fmt: skip
    llm = engine(tiny_llama, enable_lora=True, max_lora_rank=16, max_loras=2,
                 max_num_batched_tokens=40)  # fmt: skip
    prompts = POOL[:12]
    which = [loras[i % 3] if i % 3 < 2 else None for i in range(len(prompts))]
    reference = [alone(llm, [p], lora_request=w)[0] for p, w in zip(prompts, which, strict=True)]
    assert together(llm, prompts, lora_request=which) == reference


# ---- the real model, threads, another process ------------------------------------------------------


def test_smollm2_gguf_and_one_thread(gguf_path):
    """The default model's q4_1 file: a batch with chunked prompts equals each alone,
    and so does the same batch on one thread (the sums are split by rows and
    positions, never by threads)."""
    llm = LLM(gguf_path, batch_invariant=True, max_num_batched_tokens=64, max_model_len=512)
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
             "List three prime numbers:", "Water boils at", "The quick brown fox"]  # fmt: skip
    prompts = [tokenizer.encode(t * (1 + i % 3)) for i, t in enumerate(texts)]
    reference = alone(llm, prompts)
    assert together(llm, prompts) == reference
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert together(llm, prompts[::-1]) == reference[::-1]
    finally:
        torch.set_num_threads(threads)


def test_server_with_concurrent_clients_agrees_with_this_process(tiny_llama):
    prompts = POOL[:16]
    llm = engine(tiny_llama)
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0]
            for p in prompts]  # fmt: skip
    tokenizer = llm.get_tokenizer()
    expected = [
        ([tokenizer.decode([t]) for t in c.token_ids],
         [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)])
        for c in outs
    ]  # fmt: skip
    args = ["--dtype", "bfloat16", "--batch-invariant", "--max-num-batched-tokens", "32",
            "--served-model-name", "tiny"]  # fmt: skip
    with RemoteServer(tiny_llama, *args) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none")

        async def one(prompt):
            r = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                logprobs=3, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs

        async def all_at_once():
            return await asyncio.gather(*(one(p) for p in prompts))

        got = asyncio.run(all_at_once())
    assert [(list(t), list(lp)) for t, lp in got] == expected  # (JSON keeps a float exactly)


# ---- what it does not cover yet --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kernel_backend="torch"), "kernel_backend 'torch'"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    ],
)
def test_what_it_does_not_cover_is_refused_by_name(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=f"batch_invariant: .*{match}"):
        LLM(tiny_llama, batch_invariant=True, **kwargs)


def test_latent_attention_is_refused(tmp_path):
    folder = make_model(str(tmp_path / "dsv2"), "deepseek_v2")
    with pytest.raises(ValueError, match="batch_invariant: .*latent attention"):
        LLM(folder, batch_invariant=True)
