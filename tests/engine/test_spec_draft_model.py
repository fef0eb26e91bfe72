"""Speculative decoding with a draft model (`method: "draft"`): the target emits what
it emits without speculation, whatever the draft proposes.

Drafts here come from the target quantized at load (q8_0: most drafts accepted,
some not), from another random model with the same vocabulary (almost none
accepted) and, on the real model, from SmolLM2's Q4_1 blocks for its own bf16
expansion.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.engine_args import EngineArgs
from tests.helpers import assert_both_paths, completions, make_model, spec_engine, tiny_prompts

DRAFT = {
    "method": "draft",
    "quantization": "q8_0",
    "num_speculative_tokens": 4,
    "disable_by_batch_size": 64,
}


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "ngram", "model": "x"}, "model"),
        ({"method": "ngram", "quantization": "q8_0"}, "quantization"),
        ({"method": "draft", "quantization": "q3_k"}, "quantization"),
        ({"method": "draft", "model": 3}, "model"),
        ({"method": "medusa"}, "method"),
    ],
)
def test_bad_draft_config(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=spec).verify()


def test_draft_model_must_fit_the_target(tiny_llama, tiny_llava, tmp_path):
    other_vocab = make_model(str(tmp_path / "v"), "llama", vocab_size=512)
    with pytest.raises(ValueError, match="speculative_config.model .* vocabulary"):
        spec_engine(tiny_llama, {"method": "draft", "model": other_vocab})
    short = make_model(str(tmp_path / "s"), "llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="speculative_config.model .* positions"):
        spec_engine(tiny_llama, {"method": "draft", "model": short})
    with pytest.raises(ValueError, match="vision-language"):
        spec_engine(tiny_llava, {"method": "draft"})
    # vLLM's name for the method.
    llm = spec_engine(tiny_llama, {"method": "draft_model", "model": tiny_llama})
    assert llm.llm_engine.model_runner.drafter is not None


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_matches_no_speculation(tiny_llama, batch):
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), batch, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = completions(plain, prompts, params)
    spec = spec_engine(tiny_llama, DRAFT)
    assert completions(spec, prompts, params) == want
    assert_both_paths(spec)
    assert spec.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_a_different_draft_model(tiny_llama, tiny_models):
    """Another random model (same tokenizer): its drafts are mostly wrong, the output
    is the target's all the same."""
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = spec_engine(tiny_llama, {**DRAFT, "model": tiny_models["qwen2"], "quantization": "auto"})
    assert completions(spec, prompts, params) == completions(plain, prompts, params)
    stats = spec.llm_engine.get_stats().spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.5


def test_seeded_sampling_and_logprobs_match_no_speculation(tiny_llama):
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 4, seed=3)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=7, repetition_penalty=1.3, max_tokens=30),
        SamplingParams(
            temperature=0.6, seed=8, frequency_penalty=0.5, min_tokens=20, max_tokens=30
        ),  # fmt: skip
        SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True),
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = plain.generate(inputs, params, use_tqdm=False)
    spec = spec_engine(tiny_llama, DRAFT)
    got = spec.generate(inputs, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    for pa, pb in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs, strict=True):
        assert pa.keys() == pb.keys()
        for t in pa:
            assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)
    assert_both_paths(spec)


def test_preemption_and_swap_mid_speculation(tiny_llama):
    """A cache too small for the batch: requests are preempted (recomputed or swapped;
    either way the draft starts over) between speculative steps."""
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = completions(plain, prompts, params)
    per_block = 2 * plain.llm_engine.model_runner.bytes_per_block  # target + its q8_0 twin
    for mode in ("recompute", "swap"):
        llm = LLM(
            tiny_llama,
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=70 * per_block // 4,
            preemption_mode=mode,
            speculative_config=DRAFT,
        )
        assert completions(llm, prompts, params) == want
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache.num_blocks_used == 0
        assert_both_paths(llm)


def test_parallel_sampling_prefix_caching_and_grammar(tiny_llama):
    """n > 1 (forked blocks, copy-on-write), a second pass from the prefix cache, and
    a request under a grammar (not drafted for) in the same batch."""
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 3, seed=5)
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)
    want = completions(plain, prompts, params)
    spec = spec_engine(tiny_llama, DRAFT)
    assert completions(spec, prompts, params) == want
    again = [p + c[:17] for p, c in zip(prompts, want[::3], strict=True)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert completions(spec, again, greedy) == completions(plain, again, greedy)
    assert spec.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0
    assert_both_paths(spec)
    grammar = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[ab]{5,9}")
    )
    inputs = [{"prompt_token_ids": p} for p in prompts[:2]]
    got = spec.generate(inputs, [grammar, greedy], use_tqdm=False)
    want = plain.generate(inputs, [grammar, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_smollm2_q4_drafts_for_its_bf16_expansion(gguf_path):
    """The issue's case: the file's Q4_1 blocks draft for the same weights in bf16."""
    messages = [{"role": "user", "content": "Explain how a bicycle works."}]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = LLM(gguf_path, quantization="none").chat(messages, params, use_tqdm=False)
    llm = LLM(gguf_path, quantization="none", speculative_config={"method": "draft"})
    got = llm.chat(messages, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    stats = llm.llm_engine.get_stats().spec_decoding
    assert stats.acceptance_rate > 0.6 and stats.mean_accepted_length > 2


def test_long_catch_ups_run_in_chunks(tiny_llama, monkeypatch):
    """A sequence new to the draft is computed a chunk per forward: the drafts, and so
    what verification accepts, are those of one forward over it."""
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 4, seed=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = completions(plain, prompts, params)
    runs = {}
    for chunk in (2048, 16):
        monkeypatch.setattr("pagoda.worker.draft_model.DRAFT_CHUNK_TOKENS", chunk)
        llm = spec_engine(tiny_llama, DRAFT)
        forwards = runs[chunk] = []
        llm.llm_engine.model_runner.drafter.model.register_forward_hook(
            lambda _m, args, _out, forwards=forwards: forwards.append(len(args[0]))
        )
        assert completions(llm, prompts, params) == want
        forwards.append(llm.llm_engine.get_stats().spec_decoding)
    assert runs[16][-1] == runs[2048][-1]  # the same drafts, the same acceptances
    assert max(runs[2048][:-1]) > 4 * 16 >= max(runs[16][:-1])  # 4 requests' chunks at most
