"""Greedy outputs equal Hugging Face transformers' on the same weights, token for token (float32),
and stay equal under every engine setting that must not change them."""

from __future__ import annotations

import functools

import pytest

from pagoda import LLM, SamplingParams
from tests.helpers import MAX_TOKENS, greedy_reference, pagoda_greedy, tiny_prompts


@functools.cache
def _llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_matches_hf(tiny_models, arch):
    folder = tiny_models[arch]
    prompts, expected = greedy_reference(folder)
    got = pagoda_greedy(_llm(folder), prompts)  # all 16 in one generate call
    assert got == expected
    assert _llm(folder).llm_engine.get_stats().kv_cache.num_blocks_used == 0


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(max_num_seqs=1), id="max_num_seqs=1"),
        pytest.param(dict(max_num_seqs=64), id="max_num_seqs=64"),
        pytest.param(dict(max_num_batched_tokens=7), id="chunk-every-prompt"),
        pytest.param(dict(enable_prefix_caching=False), id="no-prefix-caching"),
        pytest.param(dict(kernel_backend="torch"), id="reference-attention"),
    ],
)
def test_settings_do_not_change_outputs(tiny_llama, settings):
    prompts, expected = greedy_reference(tiny_llama)
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24, **settings)
    assert pagoda_greedy(llm, prompts) == expected
    assert llm.llm_engine.get_stats().kv_cache.num_blocks_used == 0


def test_preemption_does_not_change_outputs(tiny_llama):
    prompts, expected = greedy_reference(tiny_llama)
    # 2 layers x 2 (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB a block: 20 blocks.
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=20 * 8192, max_model_len=160)
    assert llm.llm_engine.model_runner.num_blocks == 20
    assert pagoda_greedy(llm, prompts) == expected
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache.num_blocks_used == 0


def test_cached_prefix_gives_same_output_as_cold(tiny_llama):
    llm = _llm(tiny_llama)
    prompts, expected = greedy_reference(tiny_llama)
    # Second run: every prompt's full blocks are now cached.
    hits_before = llm.llm_engine.get_stats().kv_cache.prefix_cache_hits
    assert pagoda_greedy(llm, prompts) == expected
    assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > hits_before


def test_seeded_sampling_is_reproducible(tiny_llama):
    llm = _llm(tiny_llama)
    prompt = {"prompt_token_ids": tiny_prompts(llm.get_tokenizer(), n=1, seed=3)[0]}

    def run(seed, with_others: bool):
        params = SamplingParams(
            temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=20, ignore_eos=True
        )
        batch = [prompt]
        if with_others:
            others = [
                {"prompt_token_ids": p} for p in tiny_prompts(llm.get_tokenizer(), n=5, seed=4)
            ]
            batch = others[:2] + [prompt] + others[2:]
        params_list = [SamplingParams(temperature=1.5, max_tokens=30)] * len(batch)
        i = batch.index(prompt)
        params_list[i] = params
        outs = llm.generate(batch, params_list, use_tqdm=False)
        return outs[i].outputs[0].token_ids

    first = run(7, with_others=False)
    assert run(7, with_others=False) == first
    assert run(7, with_others=True) == first
    assert run(8, with_others=False) != first
    assert len(first) == 20


def test_sampling_params_shape_the_distribution(tiny_llama):
    llm = _llm(tiny_llama)
    prompt = {"prompt_token_ids": tiny_prompts(llm.get_tokenizer(), n=1, seed=5)[0]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    # top_k=1 and a tiny top_p both reduce sampling to greedy.
    for params in (
        SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, seed=1),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, seed=1),
    ):
        out = llm.generate(prompt, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids, params


def test_stop_conditions(tiny_llama):
    llm = _llm(tiny_llama)
    prompts, expected = greedy_reference(tiny_llama)
    tokens = expected[0]
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = llm.generate(
        {"prompt_token_ids": prompts[0]},
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = llm.generate(
        {"prompt_token_ids": prompts[0]},
        SamplingParams(temperature=0, max_tokens=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[:3] and out.finish_reason == "length"


def test_min_tokens_and_ignore_eos(tiny_llama):
    llm = _llm(tiny_llama)
    eos = llm.llm_engine.model_config.eos_token_ids[0]
    prompt = {"prompt_token_ids": tiny_prompts(llm.get_tokenizer(), n=1, seed=9)[0]}

    def run(**kwargs):
        # A huge bias makes EOS the greedy choice at every step, unless something forbids it.
        params = SamplingParams(temperature=0, max_tokens=12, logit_bias={eos: 100.0}, **kwargs)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    out = run()
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = run(min_tokens=4)  # EOS masked for 4 tokens, then taken
    assert len(out.token_ids) == 5 and eos not in out.token_ids[:4] and out.token_ids[4] == eos
    out = run(ignore_eos=True)  # EOS sampled but never stops the request
    assert out.token_ids == [eos] * 12 and out.finish_reason == "length"
