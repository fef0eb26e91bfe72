"""The front door (Processor): every field of a request is checked against the model's
limits and the engine's RequestLimits, a bad one raises InvalidRequestError (a
ValueError) naming it, nothing is queued, and the engine goes on serving.

Includes the inputs that used to pass validation and kill the engine thread: a stop
token id beyond the vocabulary with min_tokens, a top_k beyond int64, a lone UTF-16
surrogate in a prompt."""

from __future__ import annotations

import functools

import pytest

from pagoda import EngineArgs, LLMEngine, SamplingParams
from pagoda.errors import DeadlineUnmeetableError, InvalidRequestError

VOCAB = 400  # the tiny models' vocabulary size
SURROGATE = "ok \ud800 no"
BIG = 2**70  # past int64


@functools.cache
def _engine(folder: str) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=folder, dtype="float32", kv_cache_memory_bytes=1 << 24, max_stop_strings=4)
    )


@pytest.fixture
def engine(tiny_llama):
    engine = _engine(tiny_llama)
    yield engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache.num_blocks_used == 0


def _serves(engine: LLMEngine) -> None:
    """A normal request still runs to completion, exactly as asked."""
    engine.add_request(
        "probe", "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.finished and len(final.outputs[0].token_ids) == 4
    assert final.outputs[0].finish_reason == "length"


BAD_PARAMS = [
    # (param, SamplingParams kwargs)
    ("n", dict(n=0)),
    ("n", dict(n=10_000)),
    ("n", dict(n=True)),
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=float("inf"))),
    ("temperature", dict(temperature="hot")),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=BIG)),
    ("top_k", dict(top_k=2.5)),
    ("min_p", dict(min_p=2.0)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("frequency_penalty", dict(frequency_penalty=float("-inf"))),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("logit_bias", dict(logit_bias={VOCAB: 1.0})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={BIG: 1.0})),
    ("logit_bias", dict(logit_bias={5: 500.0})),
    ("logit_bias", dict(logit_bias={"5x": 1.0})),
    ("logit_bias", dict(logit_bias={i: 1.0 for i in range(2000)})),
    ("logit_bias", dict(logit_bias=[1, 2])),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[VOCAB])),
    ("allowed_token_ids", dict(allowed_token_ids=[BIG])),
    ("bad_words", dict(bad_words=[""])),
    ("bad_words", dict(bad_words=[SURROGATE])),
    ("bad_words", dict(bad_words=["x"] * 100)),
    ("seed", dict(seed=BIG)),
    ("seed", dict(seed="1")),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=BIG)),
    ("max_tokens", dict(max_tokens=600)),  # past the context (max_model_len 512)
    ("min_tokens", dict(min_tokens=5, max_tokens=2)),
    ("min_tokens", dict(min_tokens=-1)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=[SURROGATE])),
    ("stop", dict(stop=["a", "b", "c", "d", "e"])),  # max_stop_strings 4
    ("stop", dict(stop=["x" * 1000])),
    ("stop", dict(stop=[1])),
    ("stop_token_ids", dict(stop_token_ids=[VOCAB], min_tokens=2)),  # once killed the engine
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[BIG])),
    ("ignore_eos", dict(ignore_eos="yes")),
    ("logprobs", dict(logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ("output_kind", dict(output_kind="delta")),
]


@pytest.mark.parametrize(
    "param,kwargs", BAD_PARAMS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_PARAMS)]
)
def test_bad_sampling_params_are_refused_by_name(engine, param, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", "Hello", SamplingParams(**kwargs))
    assert e.value.param == param and param in str(e.value)
    assert isinstance(e.value, ValueError)
    assert len(str(e.value)) < 400  # a huge value is not echoed back whole
    assert "bad" not in engine.output_processor  # nothing was queued


# What SamplingParams refuses at construction (as vLLM's does): every bad value above
# that needs neither the model nor the server's limits to judge.
LIMITED = {("n", 10_000), ("max_tokens", 600), ("logprobs", 21)}
CONSTRUCTION = {"n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens",
                "ignore_eos", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"}  # fmt: skip
BAD_AT_CONSTRUCTION = [
    (param, kwargs)
    for param, kwargs in BAD_PARAMS
    if param in CONSTRUCTION and (param, kwargs.get(param)) not in LIMITED
]


@pytest.mark.parametrize("param,kwargs", BAD_AT_CONSTRUCTION)
def test_sampling_params_check_their_fields_at_construction(param, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_front_door_checks_fields_changed_after_construction(engine):
    """SamplingParams is a plain record: the front door checks again what was set later."""
    for param, value in (("temperature", -1.0), ("max_tokens", 0), ("n", 10_000)):
        params = SamplingParams()
        setattr(params, param, value)
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", "Hello", params)
        assert e.value.param == param
    _serves(engine)


BAD_PROMPTS = [
    ("prompt", ""),
    ("prompt", SURROGATE),
    ("prompt", 42),
    ("prompt", None),
    ("prompt", {"text": "hi"}),
    ("prompt", {"prompt": "hi", "extra": 1}),
    ("prompt", {"prompt": SURROGATE}),
    ("prompt_token_ids", {"prompt_token_ids": []}),
    ("prompt_token_ids", {"prompt_token_ids": [5, VOCAB]}),
    ("prompt_token_ids", {"prompt_token_ids": [5, -1]}),
    ("prompt_token_ids", {"prompt_token_ids": [5, BIG]}),
    ("prompt_token_ids", {"prompt_token_ids": [True]}),
    ("prompt_token_ids", {"prompt_token_ids": "5 6"}),
    ("prompt", {"prompt_token_ids": [5], "prompt": SURROGATE}),
    ("prompt_token_ids", {"prompt_token_ids": [5] * 600}),  # past max_model_len
    ("messages", {"messages": []}),
    ("messages", {"messages": "hi"}),
    ("messages", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("messages", {"messages": [{"role": "user", "content": SURROGATE}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("messages", {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]}),
    ("messages", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}),
    ("messages", {"messages": [{"role": "user", "content": "fox " * 600}]}),
    (
        "add_generation_prompt",
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1},
    ),
    (
        "chat_template_kwargs",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"tokenize": True},
        },
    ),
    (
        "chat_template_kwargs",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": SURROGATE}},
    ),
]


@pytest.mark.parametrize(
    "param,prompt", BAD_PROMPTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_PROMPTS)]
)
def test_bad_prompts_are_refused_by_name(engine, param, prompt):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", prompt, SamplingParams())
    assert e.value.param == param, e.value
    assert "bad" not in engine.output_processor


def test_context_length_errors_carry_openai_code(engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("long", {"prompt_token_ids": [5] * 512}, SamplingParams())
    assert e.value.code == "context_length_exceeded" and "max_model_len" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("long", {"prompt_token_ids": [5] * 500}, SamplingParams(max_tokens=13))
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    # Exactly filling the context is fine, and so is a prompt cut to its last tokens.
    engine.add_request("fits", {"prompt_token_ids": [5] * 500}, SamplingParams(max_tokens=12))
    engine.add_request(
        "cut",
        {"prompt_token_ids": [5] * 900},
        SamplingParams(max_tokens=4, truncate_prompt_tokens=8),
    )
    assert len(engine.scheduler.requests["cut"].prompt_token_ids) == 8
    engine.abort_request(["fits", "cut"])


def test_request_id_and_priority(engine):
    for request_id in ("", 5, SURROGATE, "x" * 1000):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(request_id, "Hello", SamplingParams())
        assert e.value.param == "request_id"
    for priority in (BIG, "1", 1.5):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("p", "Hello", SamplingParams(), priority=priority)
        assert e.value.param == "priority"


@pytest.mark.parametrize(
    "param, value",
    [("slo_ttft_ms", 0), ("slo_ttft_ms", -1.0), ("slo_tpot_ms", float("nan")),
     ("slo_tpot_ms", "5"), ("slo_ttft_ms", True), ("slo_tpot_ms", 1e30)],
)  # fmt: skip
def test_bad_latency_targets_are_refused_by_name(engine, param, value):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("s", "Hello", SamplingParams(), **{param: value})
    assert e.value.param == param


def test_a_target_that_cannot_be_met_is_refused_at_once(engine):
    """The engine has no targets of its own; a request's are checked against its measured
    steps: none is that fast. A ValueError naming the target, nothing queued."""
    _serves(engine)  # a measured step
    with pytest.raises(DeadlineUnmeetableError) as e:
        engine.add_request("s", "Hello", SamplingParams(), slo_ttft_ms=1e-6)
    assert isinstance(e.value, ValueError) and e.value.param == "slo_ttft_ms"
    assert e.value.retry_after >= 1 and not engine.has_unfinished_requests()
    engine.add_request("s", "Hello", SamplingParams(max_tokens=2), slo_ttft_ms=60_000)
    assert engine.scheduler.requests["s"].slo.ttft_ms == 60_000
    engine.abort_request("s")


def test_child_ids_must_be_free_too(engine):
    """A request with n = 2 runs as "<id>#0" and "<id>#1": those ids must not be taken."""
    engine.add_request("x#1", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="x#1"):
        engine.add_request("x", "Hello", SamplingParams(n=2, max_tokens=2))
    engine.abort_request("x#1")


def test_allowed_tokens_that_are_all_banned(engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(
            "b", "Hello", SamplingParams(allowed_token_ids=[2], min_tokens=1, max_tokens=3)
        )  # the tiny model's EOS is 2
    assert e.value.param == "allowed_token_ids"


def test_values_at_the_edges_are_served(engine):
    """What the limits allow runs: ids at vocab - 1, top_k far above the vocabulary,
    int64 seeds, 0 as top_k (off, as in vLLM), stop strings at the length limit."""
    params = SamplingParams(
        temperature=0.7,
        top_k=2**31 - 1,
        seed=-(2**63),
        stop_token_ids=[VOCAB - 1],
        min_tokens=2,
        max_tokens=6,
        logit_bias={str(VOCAB - 1): -100.0, 0: 0.5},
        allowed_token_ids=list(range(VOCAB)),
        stop=["x" * 256],
        logprobs=20,
        prompt_logprobs=20,
    )
    engine.add_request("edge", {"prompt_token_ids": [VOCAB - 1, 0, 7]}, params)
    engine.add_request("zero-k", "Hello", SamplingParams(top_k=0, seed=2**63 - 1, max_tokens=3))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["edge"].outputs[0].finish_reason in ("stop", "length")
    assert len(finals["edge"].outputs[0].logprobs) == len(finals["edge"].outputs[0].token_ids)
    assert finals["zero-k"].outputs[0].finish_reason is not None
    _serves(engine)


def test_engine_serves_after_every_bad_request(engine):
    for _, kwargs in BAD_PARAMS:
        with pytest.raises(ValueError):
            engine.add_request("bad", "Hello", SamplingParams(**kwargs))
    for _, prompt in BAD_PROMPTS:
        with pytest.raises(ValueError):
            engine.add_request("bad", prompt, SamplingParams())
    _serves(engine)
