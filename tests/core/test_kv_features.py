"""Issue-level behaviour of the KV cache and sampling, end to end on a tiny model:
parallel sampling with copy-on-write, swap preemption, priority preemption,
logprobs against transformers, penalties, masks, stop strings."""

from __future__ import annotations

import functools

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.attention.kv_cache import PagedKVCache, SwapPool
from tests.helpers import (
    MAX_TOKENS,
    TINY_LLAMA_BLOCK_BYTES,
    greedy_reference,
    swap_run,
    tiny_prompts,
)


@functools.cache
def _llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24, **kwargs)


def test_parallel_sampling_shares_the_prompt(tiny_llama):
    prompts, expected = greedy_reference(tiny_llama)
    llm = LLM(
        tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24, enable_prefix_caching=False
    )
    # Prompt lengths that do and do not end on a block boundary (copy-on-write or not).
    for prompt, ref in list(zip(prompts, expected, strict=True))[:6]:
        before = llm.llm_engine.get_stats().num_prompt_tokens
        out = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS),
            use_tqdm=False,
        )[0]
        # Greedy: every completion equals transformers' one, so the shared blocks were never clobbered.
        assert [c.token_ids for c in out.outputs] == [ref] * 3
        assert [c.index for c in out.outputs] == [0, 1, 2]
        # The prompt is computed once (all but its last token), then each child computes that token.
        assert llm.llm_engine.get_stats().num_prompt_tokens - before == len(prompt) - 1 + 3
    assert llm.llm_engine.get_stats().kv_cache.num_blocks_used == 0


def test_parallel_sampling_seeded_is_reproducible_and_distinct(tiny_llama):
    llm = _llm(tiny_llama)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    a = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    b = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4


def test_swap_preemption_matches_recompute(tiny_llama):
    llm = swap_run(tiny_llama, host_blocks=64)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
    assert stats.kv_cache.num_blocks_used == 0 and stats.kv_cache.num_requests_swapped == 0
    assert llm.llm_engine.kv_cache_manager.host_pool.num_free_blocks == 64


def test_swap_falls_back_to_recompute_when_host_pool_is_full(tiny_llama):
    stats = swap_run(tiny_llama, host_blocks=2).llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_swap_pool_round_trip(dtype, device):
    """Blocks swapped out, their device blocks overwritten at once (as a step reusing
    them would), several swap-outs waiting to land (one host block reused: the later
    copy wins), then swapped back in elsewhere: the same bits, scales included."""
    cache = PagedKVCache(2, 12, 4, 2, 8, dtype, device)
    for t in cache.tensors():
        t.copy_(torch.randint(0, 100, t.shape, dtype=torch.uint8).view(t.dtype)
                if t.dtype == torch.uint8 else torch.randn(t.shape).to(t.dtype))  # fmt: skip
    before = [t.clone() for t in cache.tensors()]
    swap = SwapPool(cache, 6)
    swap.swap_out(cache, [3, 7, 1], [5, 0, 2])
    swap.swap_out(cache, [9], [0])  # host block 0 freed and taken again before landing
    for t in cache.tensors():
        t[:, :, [3, 7, 1, 9]] = 0
    swap.swap_in(cache, [5, 0, 2], [10, 11, 4])
    for want, got in zip(before, cache.tensors(), strict=True):
        assert torch.equal(got[:, :, [10, 11, 4]].cpu(), want[:, :, [3, 9, 1]].cpu())
        assert torch.equal(got[:, :, [3, 7, 1, 9]], torch.zeros_like(got[:, :, [3, 7, 1, 9]]))
    # A swap-in of landed blocks does not wait for a swap-out of others in flight.
    swap.swap_out(cache, [10], [3])
    swap.swap_in(cache, [5], [7])
    assert len(swap._landing) == 1
    swap.land()
    swap.swap_in(cache, [3], [1])
    for want, got in zip(before, cache.tensors(), strict=True):
        assert torch.equal(got[:, :, [7, 1]].cpu(), want[:, :, [3, 3]].cpu())


def test_priority_request_preempts_lower_priority(tiny_llama):
    engine = LLM(
        tiny_llama,
        dtype="float32",
        kv_cache_memory_bytes=12 * TINY_LLAMA_BLOCK_BYTES,
        max_model_len=160,
        scheduling_policy="priority",
    ).llm_engine
    tok = engine.tokenizer
    low = tiny_prompts(tok, n=2, seed=21)
    for i, p in enumerate(low):
        engine.add_request(
            f"low{i}",
            {"prompt_token_ids": (p * 4)[:90]},
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            priority=5,
        )
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_requests_running == 2
    engine.add_request(
        "high",
        {"prompt_token_ids": (low[0] * 4)[:100]},
        SamplingParams(temperature=0, max_tokens=5),
        priority=0,
    )
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert "high" in running
    assert engine.get_stats().num_preemptions >= 1
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order[0] == "high" and set(finished_order) == {"high", "low0", "low1"}
    assert engine.get_stats().kv_cache.num_blocks_used == 0


def test_logprobs_match_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    llm = _llm(tiny_llama)
    prompt = tiny_prompts(llm.get_tokenizer(), n=1, seed=13)[0]
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    full = prompt + c.token_ids
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([full])).logits[0].log_softmax(-1)  # [L, V]
    # Sampled tokens: the chosen one plus the top 3, ranks included.
    assert len(c.logprobs) == 6
    for i, (token_id, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert entry[token_id].rank == 1  # greedy
        top = row.topk(3)
        for lp, tid in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)), abs=1e-4
    )
    # Prompt tokens: None for the first, then each token's logprob given what precedes it.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(
            ref[pos - 1, prompt[pos]].item(), abs=1e-4
        )
        assert entry[prompt[pos]].rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1
        assert len(entry) in (2, 3)


def test_prompt_logprobs_survive_chunking(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=8)
    prompt = tiny_prompts(llm.get_tokenizer(), n=1, seed=13)[0]
    chunked = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    whole = _llm(tiny_llama).generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    assert len(chunked.prompt_logprobs) == len(prompt)
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].logprob == pytest.approx(b[k].logprob, abs=1e-4)


def test_repetition_penalty_matches_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    llm = _llm(tiny_llama)
    prompts = tiny_prompts(llm.get_tokenizer(), n=4, seed=17)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.7, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                do_sample=False,
                repetition_penalty=1.7,
                min_new_tokens=16,
            )
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist()


def test_frequency_and_presence_penalties_discourage_repeats(tiny_llama):
    llm = _llm(tiny_llama)
    prompt = {"prompt_token_ids": tiny_prompts(llm.get_tokenizer(), n=1, seed=19)[0]}
    base = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0]
    pen = llm.generate(
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            frequency_penalty=2.0,
            presence_penalty=2.0,
        ),
        use_tqdm=False,
    )[0]
    distinct = lambda o: len(set(o.outputs[0].token_ids))  # noqa: E731
    assert distinct(pen) > distinct(base)


def test_masks_and_bias(tiny_llama):
    llm = _llm(tiny_llama)
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tiny_prompts(tok, n=1, seed=23)[0]}
    out = llm.generate(
        prompt,
        SamplingParams(temperature=1.0, max_tokens=30, allowed_token_ids=[40, 41, 42], seed=1),
        use_tqdm=False,
    )[0]
    assert set(out.outputs[0].token_ids) <= {40, 41, 42}
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=5, logit_bias={77: 100.0}), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == [77] * 5
    greedy = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0]
    word = tok.decode([greedy.outputs[0].token_ids[0]]).strip()
    banned = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[word]),
        use_tqdm=False,
    )[0]
    for ids in llm.llm_engine.processor.validator._bad_words([word]):
        if len(ids) == 1:
            assert ids[0] not in banned.outputs[0].token_ids


def test_stop_strings_cut_text_even_across_tokens(tiny_llama):
    llm = _llm(tiny_llama)
    prompt = {"prompt_token_ids": tiny_prompts(llm.get_tokenizer(), n=1, seed=29)[0]}
    full = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = full.text
    # A stop string that straddles the 3rd/4th tokens' texts.
    tok = llm.get_tokenizer()
    head = tok.decode(full.token_ids[:3])
    stop = text[len(head) - 1 : len(head) + 2]
    assert len(stop) == 3
    cut = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    idx = text.find(stop)
    assert cut.text == text[:idx]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: idx + len(stop)]
    assert llm.llm_engine.get_stats().kv_cache.num_blocks_used == 0


def test_stats_report_memory_accounting(tiny_llama):
    engine = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24).llm_engine
    engine.add_request(
        "a",
        {"prompt_token_ids": list(range(10, 30))},
        SamplingParams(max_tokens=50, ignore_eos=True),
    )
    engine.step()
    stats = engine.get_stats()
    # 20 prompt tokens + 1 sampled (computed next step) in 2 blocks of 16: 12 of 32 slots empty.
    assert stats.kv_cache.num_blocks_used == 2
    assert stats.kv_cache_fragmentation_perc == pytest.approx(100 * 12 / 32)
    assert stats.kv_cache.usage_perc == pytest.approx(100 * 2 / stats.kv_cache.num_blocks_total)
    engine.abort_request("a")
    engine.add_request("b", {"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.kv_cache.prefix_cache_hits == 16 and stats.kv_cache.prefix_cache_queries == 40
    assert stats.kv_cache.prefix_cache_hit_rate == pytest.approx(16 / 40)
