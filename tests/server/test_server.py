"""The OpenAI-compatible server, driven by the official `openai` client and httpx
against a real `pagoda serve` on 127.0.0.1 with a tiny random model.

One server for the whole module. Greedy results are checked against
`LLM.generate` / `LLM.chat` on the same model in float32.
"""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from tests.helpers import RemoteServer

PROMPTS = [
    "The quick brown fox",
    "Paged attention keeps the KV cache",
    "Hello world, how are",
    "Continuous batching schedules one step",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with RemoteServer(tiny_llama, "--served-model-name", "tiny", "tiny-alias") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 24)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- plain routes ----------------------------------------------------------------------------


def test_health_version_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"


def test_tokenize_detokenize(server, llm):
    tokenizer = llm.get_tokenizer()
    r = server.post("/tokenize", json={"model": "tiny", "prompt": PROMPTS[0]})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode(PROMPTS[0])
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    r = server.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
    assert r.json()["prompt"] == tokenizer.decode(body["tokens"])
    r = server.post("/tokenize", json={"messages": MESSAGES})
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


# ---- completions -----------------------------------------------------------------------------


def test_completion_greedy_matches_llm(client, llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in r.choices] == [e.finish_reason for e in expected]
    num_prompt = sum(len(tokenizer.encode(p)) for p in PROMPTS)
    num_completion = sum(len(e.token_ids) for e in expected)
    assert r.usage.prompt_tokens == num_prompt
    assert r.usage.completion_tokens == num_completion
    assert r.usage.total_tokens == num_prompt + num_completion

    # Token-id prompts, one and several, give the same.
    ids = [tokenizer.encode(p) for p in PROMPTS]
    r = client.completions.create(model="tiny", prompt=ids[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == expected[0].text
    r = client.completions.create(model="tiny-alias", prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in r.choices] == [e.text for e in expected]


def test_completion_stream_equals_full(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[:2], max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    finish, usage = {}, None
    for chunk in client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for c in chunk.choices:
            assert c.index not in finish, "text after the finish_reason"
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert usage.model_dump() == full.usage.model_dump()


def test_completion_stream_sse_framing(server):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])  # only with include_usage
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string(client):
    base = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[5:8]
    assert stop and text.find(stop) >= 1
    want = text[: text.find(stop)]
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == want  # nothing past the stop string was ever sent


def test_seed_reproducible(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=1.0)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_echo(client, llm):
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True
    )
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert r.choices[0].text == PROMPTS[0] + plain.choices[0].text


def test_echo_logprobs_and_prompt_logprobs(client, llm):
    """Needs the engine's prompt_logprobs."""
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    prompt_logprobs = r.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position, token_id in zip(prompt_logprobs[1:], ids[1:], strict=True):
        assert str(token_id) in position and 2 <= len(position) <= 3


def test_sampling_extras_accepted(client):
    """vLLM's extras and OpenAI's penalties pass through without error."""
    r = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="someone",
        extra_body={
            "top_k": 20,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 6,
            "priority": 1,
        },
    )
    assert r.usage.completion_tokens == 6


def test_logit_bias_forces_a_token(client, llm):
    tokenizer = llm.get_tokenizer()
    target = tokenizer.encode(" fox", add_special_tokens=False)[-1]
    r = client.completions.create(
        model="tiny",
        prompt=PROMPTS[3],
        max_tokens=5,
        temperature=0,
        logit_bias={str(target): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tokenizer.decode([target] * 5)


def test_completion_n(client):
    """Needs the engine's n > 1 (parallel sampling)."""
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, n=3, seed=7
    )
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert len({c.text for c in r.choices[:3]}) > 1
    seen = set()
    for chunk in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=1.0, n=3, stream=True
    ):
        seen.update(c.index for c in chunk.choices)
    assert seen == {0, 1, 2}


def test_completion_logprobs(client):
    """Needs the engine's logprobs."""
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 2 <= len(top) <= 3
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)  # greedy: the best
    streamed = [
        t
        for c in client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, stream=True
        )
        for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == lp.tokens


# ---- chat --------------------------------------------------------------------------------------


def test_chat_greedy_matches_llm(client, llm):
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
    # max_tokens (the older name) and text-part content give the same.
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "Hello world"}]},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=parts, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == choice.message.content


def test_chat_stream(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    body = chunks[:-1]
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == full.choices[0].message.content


def test_chat_seed_and_stop(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=99)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == a
    stop = a[3:5]
    if stop and a.find(stop) >= 1:
        r = client.chat.completions.create(stop=stop, **kwargs)
        assert r.choices[0].message.content == a[: a.find(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_chat_n(client):
    """Needs the engine's n > 1 (parallel sampling)."""
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    roles = {}
    for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, n=2, stream=True
    ):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
    assert roles == {0: "assistant", 1: "assistant"}


def test_chat_logprobs(client):
    """Needs the engine's logprobs."""
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)
        assert bytes(entry.bytes).decode() == entry.token


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_count_what_was_sent(server, client):
    before = server.wait_idle()
    usages = [
        client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=4 + i,
            temperature=0,
            extra_body={"ignore_eos": True},
        ).usage
        for i, p in enumerate(PROMPTS)
    ]
    after = server.wait_idle()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("pagoda:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("pagoda:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("pagoda:request_success_total", finished_reason="length") == len(PROMPTS)
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(f"pagoda:{name}_count") == len(PROMPTS), name
    assert delta("pagoda:request_generation_tokens_sum") == sum(u.completion_tokens for u in usages)
    assert delta("pagoda:inter_token_latency_seconds_count") == sum(
        u.completion_tokens - 1 for u in usages
    )
    assert after[("pagoda:num_blocks_used", ())] == 0
    assert after[("pagoda:kv_cache_usage_perc", ())] == 0
    assert after[("pagoda:num_blocks_total", ())] == 2048
    for name in (
        "num_requests_swapped",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ):
        assert (f"pagoda:{name}", ()) in after
    text = httpx.get(server.url + "/metrics").text
    assert 'model_name="tiny"' in text


# ---- errors: status code and OpenAI's error body -----------------------------------------------


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny"}, "prompt"),  # missing
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),  # wrong type
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),  # out of range
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [5, 999999]}, "prompt"),
        ({"prompt": [True, 5]}, "prompt"),
        ({"prompt": "hi", "allowed_token_ids": [999999]}, "allowed_token_ids"),
        ({"prompt": "hi", "max_tokens": 600}, "max_tokens"),  # past the context
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ],
)
def test_completion_bad_request(server, body, param):
    error = _error(server.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_prompt_longer_than_context(server, client):
    long_prompt = [10 + i % 300 for i in range(520)]  # max_model_len is 512
    error = _error(server.post("/v1/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "fox " * 600}]
        )
    assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny"}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"messages": MESSAGES, "max_completion_tokens": -5}, "max_completion_tokens"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
        (
            {"messages": MESSAGES, "response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format",
        ),
        ({"messages": MESSAGES, "structured_outputs": {"regex": "a("}}, "structured_outputs"),
        ({"messages": MESSAGES, "structured_outputs": {"yaml": "a"}}, "structured_outputs"),
        ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_chat_bad_request(server, body, param):
    _error(server.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        headers = {"content-type": "application/json"}
        _error(server.post(path, content=b'{"prompt": "hi",', headers=headers), 400)
        _error(server.post(path, content=b"[1, 2]", headers=headers), 400)
        _error(server.post(path, content=b"", headers=headers), 400)


def test_non_finite_numbers(server):
    headers = {"content-type": "application/json"}
    for raw, param in [
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
        (b'{"prompt": "hi", "logit_bias": {"5": -Infinity}}', "logit_bias"),
    ]:
        _error(server.post("/v1/completions", content=raw, headers=headers), 400, param)


def test_unknown_model_and_route(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    body = {"model": "gpt-17", "messages": MESSAGES}
    _error(server.post("/v1/chat/completions", json=body), 404, "model")
    _error(httpx.get(server.url + "/v1/models/gpt-17"), 404, "model")
    _error(httpx.get(server.url + "/v1/nothing-here"), 404)
    _error(httpx.get(server.url + "/v1/completions"), 405)


def test_bad_requests_do_not_harm_others(server, client):
    """A long stream runs while bad requests come and go; it finishes whole."""
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish = "", None
    for i, chunk in enumerate(stream):
        if i < 5:
            _error(server.post("/v1/completions", json={"prompt": [1, 10**9]}), 400)
            _error(server.post("/v1/chat/completions", json={"messages": 1}), 400)
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    full = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text == full.choices[0].text
    assert httpx.get(server.url + "/health").status_code == 200


def test_non_streaming_client_that_leaves_aborts(server):
    before = server.wait_idle()
    # 64 completions of 500 tokens: seconds of work on any of our CPUs (one completion
    # alone, 0.25 s on an AMD EPYC, could finish before the client gives up).
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "n": 64}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.2)
    after = server.wait_idle()
    key = ("pagoda:request_success_total", (("finished_reason", "abort"),))
    assert after[key] == before[key] + 1
    assert after[("pagoda:num_blocks_used", ())] == 0


def test_a_huge_prompt_does_not_stall_the_server(server):
    """Tokenizing runs on the processor thread, not the event loop: while a 6 MB prompt
    is being tokenized, /health answers; then the prompt gets its 400 for length."""
    big = {"model": "tiny", "prompt": "The quick brown fox jumps. " * 240_000}
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(r=server.post("/v1/completions", json=big))
    )
    thread.start()
    time.sleep(0.5)  # sent and parsed; tokenizing takes seconds
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert thread.is_alive()  # answered while the big prompt was still being tokenized
    thread.join(120)
    error = _error(result["r"], 400, "prompt")
    assert error["code"] == "context_length_exceeded"


def test_beam_search_through_the_openai_client(client, llm):
    """vLLM's extra fields: use_beam_search with n, best_of and length_penalty on
    completions and chat (whole and streamed), the same beams as `LLM.generate`."""
    extra = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.8}
    params = SamplingParams(n=2, temperature=0, max_tokens=12, **extra)
    prompt = [17, 42, 99, 7, 256, 31]
    (expected,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    texts = [c.text for c in expected.outputs]
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, n=2, extra_body=extra
    )
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == texts
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)

    messages = [{"role": "user", "content": "Hello world, how are you?"}]
    (expected,) = llm.chat(messages, params, use_tqdm=False)
    texts = [c.text for c in expected.outputs]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, n=2, extra_body=extra
    )
    assert [c.message.content for c in whole.choices] == texts
    assert [c.finish_reason for c in whole.choices] == [c.finish_reason for c in expected.outputs]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, n=2, stream=True, extra_body=extra
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
