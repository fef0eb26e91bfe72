"""Beam search (core/beams.py) against transformers' `generate(num_beams=...)` on the same
weights in float32: every returned beam token for token, its score to float32 rounding;
also under memory pressure (parked beams, preemption, swap), chunked prefill, speculative
decoding beside it, and with the blocks the beams share counted."""

from __future__ import annotations

import functools

import pytest
import torch

from pagoda import LLM, BeamSearchParams, SamplingParams
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine_args import EngineArgs
from tests.helpers import EOS_ID, TINY_LLAMA_BLOCK_BYTES, finish_all, spec_engine, tiny_prompts

PROMPTS = 6


@functools.cache
def _hf(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_beams(folder, prompt, width, max_tokens, length_penalty=1.0, early_stopping=False,
             stop_ids=(), num_return=None):  # fmt: skip
    """transformers' best beams: [(output tokens, score)], best first (width 1: its greedy
    search, which beam search of width 1 is; no score)."""
    ids = torch.tensor([prompt])
    eos = [EOS_ID, *stop_ids]
    with torch.inference_mode():
        out = _hf(folder).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
            num_beams=width, num_return_sequences=num_return or width,
            length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
            pad_token_id=EOS_ID, return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
    beams = []
    scores = out.sequences_scores if width > 1 else [None]
    for seq, score in zip(out.sequences, scores, strict=True):
        tokens = seq[len(prompt) :].tolist()
        end = next((i for i, t in enumerate(tokens) if t in eos), None)
        beams.append((tokens if end is None else tokens[: end + 1], score and score.item()))
    return beams


def assert_equal_to_hf(folder, prompts, outputs, width, max_tokens, **kwargs):
    lp = kwargs.get("length_penalty", 1.0)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = hf_beams(folder, prompt, width, max_tokens, **kwargs)
        got = [(s.tokens[len(prompt) :], s.cum_logprob) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in expected], prompt
        for (tokens, cum), (_, score) in zip(got, expected, strict=True):
            if score is not None:
                assert cum / len(tokens) ** lp == pytest.approx(score, rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24)


@pytest.fixture(scope="module")
def prompts(llm):
    return tiny_prompts(llm.get_tokenizer(), n=PROMPTS, seed=3)


def as_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize(
    "width, length_penalty, early_stopping, max_tokens",
    [(4, 1.0, False, 16), (3, 0.5, True, 12), (4, 2.0, "never", 10), (2, -1.0, False, 20),
     (1, 1.0, False, 8)],
)  # fmt: skip
def test_beam_search_equals_transformers(
    llm, tiny_llama, prompts, width, length_penalty, early_stopping, max_tokens
):
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outputs = llm.beam_search(as_prompts(prompts), params)
    assert all(len(o.sequences) == width for o in outputs)
    assert_equal_to_hf(
        tiny_llama, prompts, outputs, width, max_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping,
    )  # fmt: skip
    assert llm.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


def frequent_tokens(llm, prompts, k: int) -> list[int]:
    """The tokens greedy decoding picks most: as stop tokens, beams end early and often."""
    outs = llm.generate(as_prompts(prompts), SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)  # fmt: skip
    counts = torch.bincount(torch.tensor([t for o in outs for t in o.outputs[0].token_ids]))
    return counts.topk(k).indices.tolist()


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beams_that_end_on_stop_tokens(llm, tiny_llama, prompts, early_stopping):
    """Finished hypotheses (six stop tokens beside EOS: 21 candidates a beam), their
    length penalty and the early-stop rules, against transformers with the same EOS set."""
    stops = frequent_tokens(llm, prompts, 6)
    params = SamplingParams(
        n=3, temperature=0, use_beam_search=True, max_tokens=14, stop_token_ids=stops,
        early_stopping=early_stopping, length_penalty=0.7, logprobs=0,
    )  # fmt: skip
    outs = llm.generate(as_prompts(prompts), params, use_tqdm=False)
    ended = 0
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_beams(tiny_llama, prompt, 3, 14, 0.7, early_stopping, stops)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in expected]
        for c in out.outputs:
            own = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            assert c.cumulative_logprob == pytest.approx(sum(own), abs=1e-4)
            stopped = c.token_ids[-1] in stops
            ended += stopped
            assert c.finish_reason == ("stop" if stopped else "length")
            assert c.stop_reason == (c.token_ids[-1] if stopped else None)
    assert ended >= PROMPTS, "the stop tokens should end beams early"


def test_n_best_of_the_beams(llm, tiny_llama, prompts):
    """n < best_of: the n best of best_of beams."""
    params = SamplingParams(n=2, best_of=5, temperature=0, use_beam_search=True, max_tokens=10)
    outs = llm.generate(as_prompts(prompts[:3]), params, use_tqdm=False)
    for prompt, out in zip(prompts[:3], outs, strict=True):
        expected = hf_beams(tiny_llama, prompt, 5, 10, num_return=2)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in expected]


def test_beams_beside_other_requests(llm, prompts):
    """Beam searches and sampled requests in one batch: each as it is alone."""
    beam = SamplingParams(n=3, temperature=0, use_beam_search=True, max_tokens=12)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=12, n=2)
    alone = [llm.generate(as_prompts(prompts), p, use_tqdm=False) for p in (beam, greedy, seeded)]
    mixed = llm.generate(as_prompts(prompts) * 3, [beam] * PROMPTS + [greedy] * PROMPTS
                         + [seeded] * PROMPTS, use_tqdm=False)  # fmt: skip
    tokens = [[c.token_ids for c in o.outputs] for o in mixed]
    assert tokens == [[c.token_ids for c in o.outputs] for outs in alone for o in outs]


def reference(llm, prompts, width=4, max_tokens=24):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=0.8)
    return [[s.tokens for s in o.sequences] for o in llm.beam_search(as_prompts(prompts), params)]


@pytest.mark.parametrize(
    "settings",
    [
        dict(kv_cache_memory_bytes=14 * TINY_LLAMA_BLOCK_BYTES),
        dict(kv_cache_memory_bytes=14 * TINY_LLAMA_BLOCK_BYTES, enable_prefix_caching=False),
        dict(kv_cache_memory_bytes=14 * TINY_LLAMA_BLOCK_BYTES, preemption_mode="swap",
             swap_space=40 * TINY_LLAMA_BLOCK_BYTES),
        dict(max_num_batched_tokens=32, max_num_seqs=3),
    ],
    ids=["tiny-cache", "tiny-cache-no-prefix-cache", "tiny-cache-swap", "chunked-few-seqs"],
)  # fmt: skip
def test_beams_under_pressure(llm, tiny_llama, prompts, settings):
    """A cache of 14 blocks (224 tokens) for 6 searches of 4 beams up to 150 tokens each:
    beams are preempted and parked, their continuations recomputed; or steps of 32 tokens
    and 3 sequences. The same beams as with room, and every block free at the end."""
    tight = LLM(tiny_llama, dtype="float32", max_model_len=160, **settings)
    assert reference(tight, prompts) == reference(llm, prompts)
    engine = tight.llm_engine
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    assert not engine.scheduler.requests and not engine.scheduler.beams.group_of
    if "kv_cache_memory_bytes" in settings:
        assert sum(engine.scheduler.num_preemptions.values()) > 0


def test_beams_share_their_blocks(tiny_llama, prompts):
    """Forked beams hold the prompt's blocks by reference: the pool holds each shared block
    once, so the search uses far fewer blocks than its beams' tables add up to."""
    engine = LLMEngine(EngineArgs(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24))
    prompt = (prompts[0] * 3)[:100]  # 7 blocks
    params = SamplingParams(n=4, temperature=0, use_beam_search=True, max_tokens=8)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    kv, largest = engine.kv_cache_manager, (0, 0)
    while engine.has_unfinished_requests():
        engine.step()
        beams = list(engine.scheduler.beams.group_of)
        tables = sum(kv.num_blocks_of(b) for b in beams)
        largest = max(largest, (tables, kv.block_pool.num_used_blocks))
    tables, used = largest
    assert tables == 4 * 7 and used <= 7 + 4, (tables, used)
    assert kv.block_pool.num_used_blocks == 0


def test_abort_a_beam_search(tiny_llama, prompts):
    engine = LLMEngine(EngineArgs(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24))
    params = SamplingParams(n=3, temperature=0, use_beam_search=True, max_tokens=30)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params)
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, params)
    for _ in range(5):
        engine.step()
    assert len(engine.scheduler.beams.group_of) == 6
    (aborted,) = engine.abort_request("a")
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    finals = finish_all(engine)
    assert list(finals) == ["b"] and len(finals["b"].outputs) == 3
    assert not engine.scheduler.requests and not engine.scheduler.beams.by_completion
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_beams_beside_speculative_decoding(tiny_llama, prompts):
    """n-gram drafts for the greedy requests; none for beams, whose result is unchanged."""
    spec = spec_engine(tiny_llama)
    params = SamplingParams(n=3, temperature=0, use_beam_search=True, max_tokens=16)
    plain = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24)
    both = [
        [[c.token_ids for c in o.outputs] for o in e.generate(as_prompts(prompts), params,
                                                              use_tqdm=False)]
        for e in (spec, plain)
    ]  # fmt: skip
    assert both[0] == both[1]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(use_beam_search=True), "temperature"),  # the default temperature is 1
        (dict(use_beam_search=True, temperature=0, stop=["x"]), "stop"),
        (dict(use_beam_search=True, temperature=0, top_p=0.5), "top_p"),
        (dict(use_beam_search=True, temperature=0, n=3, best_of=2), "best_of"),
        (dict(best_of=3), "best_of"),
        (dict(length_penalty=0.5), "length_penalty"),
        (dict(use_beam_search=True, temperature=0, early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_beam_search_parameters_are_checked(kwargs, param):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


@pytest.mark.parametrize(
    "kwargs, param",
    [(dict(logprobs=2), "logprobs"), (dict(n=65), "n"), (dict(n=2, best_of=300), "best_of")],
)
def test_beam_search_limits_at_the_front_door(llm, prompts, kwargs, param):
    params = SamplingParams(temperature=0, use_beam_search=True, **kwargs)
    with pytest.raises(ValueError) as e:
        llm.generate(as_prompts(prompts[:1]), params, use_tqdm=False)
    assert e.value.param == param
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(as_prompts(prompts[:1]), SamplingParams())
