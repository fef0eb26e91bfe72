"""Speculative decoding (n-gram prompt lookup): what it emits is what decoding one
token a step emits.

Greedy and seeded requests give exactly the tokens of a run without speculation
(a seeded draw follows the output index, so the same noise meets the same
logits); unseeded sampling keeps the target's distribution (chi-square against
Hugging Face's probabilities). A random tiny model rarely repeats itself, so
most tests draft with an oracle in place of the n-gram lookup: the run without
speculation's next tokens, one of them spoiled at a varying place, so drafts are
accepted in part, whole, or not at all; each test checks that both happened.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.core.ngram import propose_ngram
from pagoda.engine_args import EngineArgs
from tests.helpers import (
    NGRAM,
    RemoteServer,
    assert_both_paths,
    completions,
    spec_engine,
    tiny_prompts,
)


def test_propose_ngram():
    # The longest suffix that occurred before wins; then the most recent occurrence.
    assert propose_ngram([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [4, 5]
    assert propose_ngram([5, 1, 6, 1, 7, 1], 3, 1, 2) == [7, 1]  # most recent "1"
    assert propose_ngram([1, 2, 3, 1, 2], 10, 2, 2) == [3, 1, 2]  # up to the end
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([7, 7], 3, 1, 1) == [7]
    assert propose_ngram([1, 2, 3, 1, 2], 0, 1, 2) == []
    # Ids whose bytes match across an id boundary are not a match.
    a, b = 0x01000000, 0x00000002
    assert propose_ngram([a, b, 0x02000000, 0x0100, 5, 0x02000000, 0x0100], 1, 2, 2) == [5]
    assert propose_ngram([0x00020000, 0x00000100, 9, 0x02000000, 0x0100], 1, 2, 2) == []


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 8}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"lookahead": 3}, "lookahead"),
        ("ngram", "dict"),
    ],
)
def test_bad_speculative_config(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=spec).verify()
    assert SpeculativeConfig.from_dict({}).method == "ngram"


@pytest.fixture
def oracle(monkeypatch):
    """`oracle.expect(prompts, outputs)`: from then on the scheduler's drafts are the
    expected continuation, one token of it spoiled at a place that varies (or none)."""
    expected: dict[tuple[int, ...], list[list[int]]] = {}

    def propose(token_ids, k, n_min, n_max):
        for prompt, outputs in expected.items():
            if tuple(token_ids[: len(prompt)]) != prompt:
                continue
            done = len(token_ids) - len(prompt)
            for output in outputs:
                if output[:done] != token_ids[len(prompt) :]:
                    continue  # another completion of the same prompt
                draft = list(output[done : done + k])
                spoil = len(token_ids) * 7 % 6  # 4, 5: none
                if spoil < len(draft):
                    draft[spoil] = (draft[spoil] + 1) % 300
                return draft
        return []

    class Oracle:
        @staticmethod
        def expect(prompts, outputs):
            for p, o in zip(prompts, outputs, strict=True):
                expected.setdefault(tuple(p), []).append(o)

    monkeypatch.setattr("pagoda.core.drafts.propose_ngram", propose)
    return Oracle


def repetitive_prompts(tokenizer, n: int, seed: int = 1) -> list[list[int]]:
    """Prompts that repeat a stretch of themselves: n-gram drafts to verify."""
    return [p[:20] + p[:12] + p[20:30] + p[:8] for p in tiny_prompts(tokenizer, n, seed)]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_matches_no_speculation(tiny_llama, oracle, batch):
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), batch, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = completions(plain, prompts, params)
    oracle.expect(prompts, want)
    spec = spec_engine(tiny_llama, NGRAM)
    assert completions(spec, prompts, params) == want
    assert_both_paths(spec)
    assert spec.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0  # nothing leaked


def test_seeded_sampling_matches_no_speculation(tiny_llama, oracle):
    """Penalties, min_tokens, bad words and stop strings see the drafts as output so far."""
    plain = spec_engine(tiny_llama)
    tokenizer = plain.get_tokenizer()
    prompts = tiny_prompts(tokenizer, 6, seed=2)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True)
        for i in range(3)
    ] + [
        SamplingParams(temperature=0.5, seed=7, repetition_penalty=1.3, max_tokens=30),
        SamplingParams(
            temperature=0.6, seed=8, frequency_penalty=0.5, min_tokens=20, max_tokens=30
        ),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = plain.generate(inputs, params, use_tqdm=False)
    # The greedy one again, banning a word it said and stopping at a later stretch of text.
    said = want[5].outputs[0].token_ids
    params[5] = SamplingParams(
        temperature=0,
        max_tokens=40,
        ignore_eos=True,
        bad_words=[tokenizer.decode(said[2:4])],
        stop=[tokenizer.decode(said[25:27]).strip() or "fox"],
    )
    want = plain.generate(inputs, params, use_tqdm=False)
    oracle.expect(prompts, [o.outputs[0].token_ids for o in want])
    spec = spec_engine(tiny_llama, NGRAM)
    got = spec.generate(inputs, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert_both_paths(spec)


def test_logprobs_match_no_speculation(tiny_llama, oracle):
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 2, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = plain.generate(inputs, params, use_tqdm=False)
    oracle.expect(prompts, [o.outputs[0].token_ids for o in want])
    spec = spec_engine(tiny_llama, NGRAM)
    got = spec.generate(inputs, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and len(ca.logprobs) == len(cb.logprobs)
        for pa, pb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)
                assert pa[t].rank == pb[t].rank
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    assert_both_paths(spec)


def test_preemption_mid_speculation_gives_the_same_output(tiny_llama, oracle):
    """A cache too small for the batch: requests are preempted (recomputed, or swapped)
    between speculative steps and still give the output of a run without either."""
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = completions(plain, prompts, params)
    oracle.expect(prompts, want)
    for mode in ("recompute", "swap"):
        llm = LLM(
            tiny_llama,
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=70 * plain.llm_engine.model_runner.bytes_per_block // 4,
            preemption_mode=mode,
            speculative_config=NGRAM,
        )
        assert completions(llm, prompts, params) == want
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache.num_blocks_used == 0
        assert_both_paths(llm)


def test_parallel_sampling_and_prefix_caching(tiny_llama, oracle):
    """n > 1 (forked blocks, copy-on-write) and a second pass served from the prefix
    cache: rejected drafts never become findable as cached blocks."""
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 3, seed=5)
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)
    want = completions(plain, prompts, params)
    oracle.expect([p for p in prompts for _ in range(3)], want)
    spec = spec_engine(tiny_llama, NGRAM)
    assert completions(spec, prompts, params) == want
    # Again, with the prompts and the first outputs as new prompts: cache hits.
    again = [p + c[:17] for p, c in zip(prompts, want[::3], strict=True)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want_again = completions(plain, again, greedy)
    oracle.expect(again, want_again)
    assert completions(spec, again, greedy) == want_again
    assert spec.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0
    assert_both_paths(spec)


def test_off_for_large_batches(tiny_llama, oracle):
    plain = spec_engine(tiny_llama)
    prompts = tiny_prompts(plain.get_tokenizer(), 4, seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = completions(plain, prompts, params)
    oracle.expect(prompts, want)
    spec = spec_engine(tiny_llama, {**NGRAM, "disable_by_batch_size": 5})
    assert completions(spec, prompts, params) == want
    assert spec.llm_engine.get_stats().spec_decoding.num_drafts > 0
    off = spec_engine(tiny_llama, {**NGRAM, "disable_by_batch_size": 4})
    assert completions(off, prompts, params) == want
    assert off.llm_engine.get_stats().spec_decoding.num_drafts == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_keeps_the_target_distribution(tiny_llama, monkeypatch, method):
    """Unseeded draws: the token at a drafted position (the accepted draft or its
    replacement) and the one after an accepted draft follow Hugging Face's
    probabilities (chi-square). The drafts are the target's likeliest tokens: fixed in
    advance in place of the n-gram lookup, or a draft model's greedy choices with the
    target's own weights as the draft."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    temperature = 0.6
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1].double()
        return (logits / temperature).softmax(-1)

    spec = NGRAM if method == "ngram" else {"method": "draft", "num_speculative_tokens": 2}
    llm = spec_engine(tiny_llama, {**spec, "disable_by_batch_size": 1000}, max_num_seqs=256, seed=3)
    prompt = tiny_prompts(llm.get_tokenizer(), 1, seed=7)[0]
    first = int(probs(prompt).argmax())
    p1 = probs(prompt + [first])
    d1 = int(p1.argmax())
    p2 = probs(prompt + [first, d1])
    draft = [d1, int(p2.argmax())]
    # Drafts only after the prefill sampled `first`: every such draw verifies the same two.
    monkeypatch.setattr(
        "pagoda.core.drafts.propose_ngram",
        lambda tokens, k, *_: draft[:k] if tokens == prompt + [first] else [],
    )
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3000, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs if o.outputs[0].token_ids[0] == first]
    assert_both_paths(llm)

    def check(observed: list[int], p: torch.Tensor) -> None:
        counts = torch.bincount(torch.tensor(observed), minlength=p.numel()).double()
        big = p * len(observed) >= 10  # bins expected 10+ times; the rest pooled
        f_obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
        f_exp = torch.cat([p[big], p[~big].sum(0, keepdim=True)]) * len(observed)
        assert big.sum() >= 3
        result = chisquare(f_obs.numpy(), f_exp.numpy())
        assert result.pvalue > 1e-3, result

    assert len(tokens) > 500
    check([t[1] for t in tokens], p1)
    after = [t[2] for t in tokens if t[1] == d1]
    assert len(after) > 200
    check(after, p2)


def test_smollm2_ngram_on_a_grounded_prompt(gguf_path):
    """The real thing: SmolLM2 (Q4_1, bf16 activations) asked to repeat a text drafts
    from it by n-gram lookup, accepts most drafts, and says exactly what it says
    without speculation (the decode kernels give each row what a one-row call does)."""
    text = (
        "Paged attention keeps the KV cache in fixed-size blocks with a block table per "
        "request, so memory is allocated on demand and shared between requests."
    )
    messages = [{"role": "user", "content": f"Repeat this sentence exactly:\n\n{text}"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = LLM(gguf_path).chat(messages, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(gguf_path, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    got = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    stats = llm.llm_engine.get_stats().spec_decoding
    assert stats.acceptance_rate > 0.5 and stats.mean_accepted_length > 2


def test_server_speculative_config_and_metrics(tiny_llama):
    """`pagoda serve --speculative-config JSON`: greedy completions, streamed or not,
    equal LLM.generate's without speculation; /metrics counts drafts per position."""
    import json

    import httpx

    plain = spec_engine(tiny_llama)
    prompt = tiny_prompts(plain.get_tokenizer(), 1, seed=8)[0]
    want = completions(plain, [prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    spec = json.dumps(NGRAM)
    with RemoteServer(tiny_llama, "--speculative-config", spec) as server:
        client = server.client()
        kwargs = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=40)
        r = client.completions.create(temperature=0, **kwargs)
        text = plain.get_tokenizer().decode(want, skip_special_tokens=True)
        assert r.choices[0].text == text
        stream = client.completions.create(temperature=0, stream=True, **kwargs)
        assert "".join(c.choices[0].text for c in stream) == text
        metrics = httpx.get(server.url + "/metrics").text
    drafts = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pagoda:spec_decode_num_drafted_tokens_per_pos_total{")
    ]
    assert len(drafts) == NGRAM["num_speculative_tokens"] and drafts[0] > 0
    assert "pagoda:spec_decode_num_accepted_tokens_total{" in metrics


# ---- the scheduler alone: drafts' blocks -------------------------------------------------


def spec_scheduler(num_blocks: int, k: int, **config):
    import dataclasses

    from pagoda.config import SchedulerConfig
    from pagoda.core.kv_cache_manager import KVCacheManager
    from pagoda.core.scheduler import Scheduler
    from pagoda.request import Request

    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=1024,
        speculative=SpeculativeConfig.from_dict({"num_speculative_tokens": k}),
        **config,
    )
    kv = KVCacheManager(num_blocks, 4, True, num_host_blocks=16)
    scheduler = Scheduler(cfg, kv)

    def request(rid: str, prompt: list[int], priority: int = 0) -> Request:
        params = dataclasses.replace(SamplingParams(max_tokens=100), eos_token_ids=())
        return Request(rid, prompt, params, priority, 0.0)

    def step(answers: dict[str, list[int]]):
        from pagoda.core.sched_output import ModelRunnerOutput

        out = scheduler.schedule()
        ids = [s.request_id for s in out.scheduled if s.sampling_params is not None]
        scheduler.update_from_output(out, ModelRunnerOutput(ids, [answers[i] for i in ids]))
        return out

    return scheduler, kv, request, step


def test_rejected_drafts_give_their_blocks_back_and_swap_in_fits():
    """A's drafts take 4 blocks and are rejected; then B swaps A out. A must come back
    in the blocks its computed tokens need (it once took more, and crashed swap-in)."""
    scheduler, kv, request, step = spec_scheduler(7, 4, scheduling_policy="priority",
                                                  preemption_mode="swap")  # fmt: skip
    scheduler.add_request(request("A", [1, 2, 3, 4, 5, 1, 2, 3], priority=5))
    step({"A": [4]})
    out = step({"A": [7]})  # drafts 5 1 2 3, the target says 7
    assert out.scheduled[0].num_draft_tokens == 4
    assert kv.num_blocks_of("A") == 3  # 10 tokens computed: 3 blocks, not 4
    scheduler.add_request(request("B", list(range(100, 115))))
    for n in range(4):
        step({"A": [900 + n], "B": [800 + n]})
    assert scheduler.get_stats().num_preemptions_swap == 1
    assert kv.is_swapped(scheduler.requests["A"])
    assert len(kv.requests["A"].host_block_ids) == 3
    from pagoda.request import RequestStatus

    scheduler.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    out = step({"A": [950]})
    assert len(out.blocks_to_swap_in) == 3 and [s.request_id for s in out.scheduled] == ["A"]


def test_drafts_never_preempt_another_request():
    scheduler, kv, request, step = spec_scheduler(7, 7)
    scheduler.add_request(request("A", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]))
    scheduler.add_request(request("B", [50, 51, 52, 53, 54, 55, 56, 57]))
    step({"A": [3], "B": [60]})
    out = step({"A": [99], "B": [61]})  # A drafts 4 5 6 ... but only into a spare block
    assert not out.preempted_request_ids
    assert [s.request_id for s in out.scheduled] == ["A", "B"]
    assert 0 < out.scheduled[0].num_draft_tokens < 7
