"""No request can hurt another: every class of bad input to a live `pagoda serve` gets a
4xx with OpenAI's error body, and afterwards the engine still serves and holds no
KV block. Then a property-based fuzz (hypothesis) of completions, chat, tokenize and
detokenize that draws values at the model's edges: ids at and past the vocabulary,
integers at and past int64, lone surrogates, empty and huge lists, in every field.

Set PAGODA_FUZZ_EXAMPLES to fuzz longer than CI does (the default is fixed and
derandomized, so CI runs the same bodies every time).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import RemoteServer

VOCAB = 400  # the tiny model's vocabulary
INT64 = 2**63
SURROGATE = "ok \ud800 no"
MESSAGES = [{"role": "user", "content": "Hello world"}]
LIMITS = ["--max-n", "4", "--max-tokens-limit", "32", "--max-stop-strings", "4"]
BODY_LIMIT = 1 << 18


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = ["--served-model-name", "tiny", "--max-num-seqs", "16", *LIMITS]
    with RemoteServer(tiny_llama, *args, "--max-request-body-bytes", str(BODY_LIMIT)) as s:
        yield s


def post(server: RemoteServer, path: str, body) -> httpx.Response:
    """`body` as JSON text (surrogates escaped, NaN and Infinity allowed, as a client may send)."""
    headers = {"content-type": "application/json"}
    return server.post(path, content=json.dumps(body).encode(), headers=headers)


def assert_error(r: httpx.Response, status: int | None = None, param: str | None = None):
    assert 400 <= r.status_code < 500 if status is None else r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert len(error["message"]) < 2000  # a huge bad value is not echoed whole
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serves(server: RemoteServer) -> None:
    """The engine answers a normal request exactly as asked and then holds no block."""
    body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.wait_idle()[("pagoda:num_blocks_used", ())] == 0


def completion(**fields) -> dict:
    return {"prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"messages": MESSAGES, "max_tokens": 4, **fields}


# (route, body, the param the error must name)
CASES = [
    # Token ids out of [0, vocab) in every id field.
    ("/v1/completions", completion(prompt=[5, VOCAB]), "prompt"),
    ("/v1/completions", completion(prompt=[[5], [-1]]), "prompt"),
    ("/v1/completions", completion(logit_bias={str(VOCAB): 1}), "logit_bias"),
    ("/v1/completions", completion(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
    ("/v1/completions", completion(stop_token_ids=[VOCAB], min_tokens=2), "stop_token_ids"),
    ("/v1/chat/completions", chat(stop_token_ids=[10**6]), "stop_token_ids"),
    ("/v1/chat/completions", chat(logit_bias={"-3": 1}), "logit_bias"),
    ("/detokenize", {"tokens": [1, VOCAB]}, "tokens"),
    # Integers past int64 (and past their own bounds) in every integer field.
    ("/v1/completions", completion(top_k=2**70), "top_k"),
    ("/v1/completions", completion(seed=INT64), "seed"),
    ("/v1/completions", completion(seed=-INT64 - 1), "seed"),
    ("/v1/completions", completion(max_tokens=INT64), "max_tokens"),
    ("/v1/completions", completion(n=INT64), "n"),
    ("/v1/completions", completion(min_tokens=INT64), "min_tokens"),
    ("/v1/completions", completion(logprobs=INT64), "logprobs"),
    ("/v1/completions", completion(prompt_logprobs=-1), "prompt_logprobs"),
    ("/v1/completions", completion(priority=INT64), "priority"),
    ("/v1/completions", completion(truncate_prompt_tokens=INT64), "truncate_prompt_tokens"),
    ("/v1/completions", completion(prompt=[INT64]), "prompt"),
    ("/v1/completions", completion(allowed_token_ids=[2**64]), "allowed_token_ids"),
    ("/v1/chat/completions", chat(max_completion_tokens=INT64), "max_completion_tokens"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=INT64), "top_logprobs"),
    ("/detokenize", {"tokens": [2**64]}, "tokens"),
    # Lone surrogates in every string field.
    ("/v1/completions", completion(prompt=SURROGATE), "prompt"),
    ("/v1/completions", completion(prompt=["fine", SURROGATE]), "prompt"),
    ("/v1/completions", completion(stop=SURROGATE), "stop"),
    ("/v1/completions", completion(stop=["a", SURROGATE]), "stop"),
    ("/v1/completions", completion(bad_words=[SURROGATE]), "bad_words"),
    ("/v1/completions", completion(user=SURROGATE), "user"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": SURROGATE}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": SURROGATE, "content": "hi"}]), "messages"),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
        "messages",
    ),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "hi", "name": SURROGATE}]),
        "messages",
    ),
    ("/v1/chat/completions", chat(chat_template_kwargs={"x": SURROGATE}), "chat_template_kwargs"),
    ("/v1/chat/completions", chat(metadata={"k": SURROGATE}), "metadata"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    # Huge n, many or long stop strings, big lists.
    ("/v1/completions", completion(n=10**6), "n"),
    ("/v1/completions", completion(n=5), "n"),  # --max-n 4
    ("/v1/completions", completion(stop=[str(i) for i in range(5)]), "stop"),
    ("/v1/completions", completion(stop=["x" * 1000]), "stop"),
    ("/v1/completions", completion(bad_words=[str(i) for i in range(100)]), "bad_words"),
    ("/v1/completions", completion(logit_bias={str(i): 1 for i in range(2000)}), "logit_bias"),
    ("/v1/completions", completion(prompt=["Hello"] * 300), "prompt"),
    ("/v1/completions", completion(prompt=[]), "prompt"),
    ("/v1/completions", completion(prompt=""), "prompt"),
    ("/v1/completions", completion(max_tokens=33), "max_tokens"),  # --max-tokens-limit 32
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    # Fields pagoda does not know, or values it cannot honour: refused by name.
    ("/v1/completions", completion(frobnicate=1), "frobnicate"),
    ("/v1/completions", completion(use_beam_search=True, temperature=0.7), "temperature"),
    ("/v1/completions", completion(use_beam_search=True, stop=["x"]), "stop"),
    ("/v1/completions", completion(use_beam_search=True, logprobs=2), "logprobs"),
    ("/v1/completions", completion(use_beam_search=True, n=2, best_of=5), "best_of"),  # --max-n 4
    ("/v1/completions", completion(use_beam_search=True, early_stopping="soon"), "early_stopping"),
    ("/v1/completions", completion(best_of=3), "best_of"),
    ("/v1/completions", completion(length_penalty=0.5), "length_penalty"),
    ("/v1/completions", completion(guided_json={"type": "objec"}), "guided_json"),
    ("/v1/completions", completion(suffix="x"), "suffix"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), "tools"),
    ("/v1/chat/completions", chat(chat_template="{{ 7 * 7 }}"), "chat_template"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "hi", "tool_calls": []}]),
        "messages",
    ),
]


@pytest.mark.parametrize(
    "route,body,param", CASES, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(CASES)]
)
def test_bad_input_gets_a_4xx_naming_the_field(server, route, body, param):
    assert_error(post(server, route, body), 400, param)


def test_every_bad_input_leaves_the_engine_serving(server):
    for route, body, _ in CASES:
        assert post(server, route, body).status_code == 400
    assert_serves(server)


def test_non_finite_numbers_and_deep_json(server):
    headers = {"content-type": "application/json"}
    for raw in (
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "logit_bias": {"5": -Infinity}}',
        b'{"prompt": "hi", "top_p": 1e999}',
        b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",  # deeper than Python's parser goes
        b'{"prompt": "hi", "\\ud800": 1}',  # an unknown field named by a lone surrogate
        b'{"prompt": "hi", "model": "\\udfff"}',
    ):
        assert_error(server.post("/v1/completions", content=raw, headers=headers), 400)
    assert_serves(server)


def test_oversized_body_gets_413(server):
    big = {"prompt": "x" * (BODY_LIMIT + 1)}
    error = assert_error(post(server, "/v1/completions", big), 413)
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies to the bytes as they arrive
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = server.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(r, 413)
    assert_serves(server)


def test_a_stream_with_bad_input_fails_before_it_starts(server):
    """Every check runs before the 200: a bad streaming request gets a plain 400."""
    body = completion(prompt=SURROGATE, stream=True)
    assert_error(post(server, "/v1/completions", body), 400, "prompt")
    body = chat(stop_token_ids=[VOCAB], min_tokens=3, stream=True)
    assert_error(post(server, "/v1/chat/completions", body), 400, "stop_token_ids")


def test_vllm_extras_that_are_honoured(server):
    r = post(
        server, "/v1/completions", completion(use_beam_search=False, best_of=1, length_penalty=1.0)
    )
    assert r.status_code == 200, r.text
    body = completion(
        prompt=[5, 6, 7, 8, 9, 10],
        truncate_prompt_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    r = post(server, "/v1/completions", body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all(e["usage"]["prompt_tokens"] == 2 for e in events)  # usage in every chunk
    assert events[-1]["usage"]["completion_tokens"] == 4


# ---- the fuzz ------------------------------------------------------------------------------
#
# A schema-driven fuzzer draws every field at random, so nearly every body is refused for
# some field or other and the engine never sees a value at its edge: it found none of the
# inputs that once killed the engine. Here a body is plausible in every field (values at
# the edges that are allowed included), and then at most one field is set to a value at or
# past an edge (an id at the vocabulary size, an integer past int64, a lone surrogate, an
# empty or huge list) or to something of another type, or an unknown field is added.

EDGE_INTS = [-1, VOCAB, VOCAB + 1, 2**31, INT64, -INT64 - 1, 2**64, 10**30]

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=5),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip
edge_int = st.sampled_from(EDGE_INTS)
surrogate = st.sampled_from(["\ud800", "a\udfffb", "ok \udbff\udbff", "\udc00 x"])
token = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([0, VOCAB - 1]))
tokens = st.lists(token, min_size=1, max_size=8)
word = st.one_of(st.text(min_size=1, max_size=8), st.sampled_from(["</s>", "<|user|>", "😀", "e"]))
words = st.lists(word, min_size=1, max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(min_size=1, max_size=30)},
    optional={"name": st.text(min_size=1, max_size=5)},
)  # fmt: skip
messages = st.lists(message, min_size=1, max_size=3)


def plus(good, bad):
    """A plausible list with one bad item added."""
    return st.tuples(good, bad).map(lambda t: [*t[0], t[1]])


def message_with(bad):
    return st.tuples(message, st.sampled_from(["role", "content", "name"]), bad).map(
        lambda t: {**t[0], t[1]: t[2]}
    )


# Each field: its plausible values (allowed edges included) and, per kind of edge, values
# at or past it. Kinds: "surrogate" (a lone UTF-16 surrogate in the text), "id" (a token
# id at or past the vocabulary, or negative), "int" (past int64 or the field's range),
# "size" (empty or huge). Every field also gets "junk" (another type entirely).
SAMPLING = {
    "model": (st.just("tiny"), {"surrogate": surrogate}),
    "n": (st.integers(1, 4), {"int": edge_int}),
    "temperature": (st.floats(0, 2), {"int": st.sampled_from([-0.5, 1e308, -1e308])}),
    "top_p": (st.floats(0.01, 1), {"int": st.sampled_from([0.0, 1.5, -1.0])}),
    "top_k": (
        st.one_of(st.integers(-1, 50), st.sampled_from([VOCAB, 2**31 - 1])),
        {"int": edge_int},
    ),
    "min_p": (st.floats(0, 1), {"int": st.sampled_from([-0.1, 1.5])}),
    "presence_penalty": (st.floats(-2, 2), {"int": st.sampled_from([-2.5, 1e308])}),
    "frequency_penalty": (st.floats(-2, 2), {"int": st.sampled_from([2.5, -1e308])}),
    "repetition_penalty": (st.floats(0.5, 2), {"int": st.sampled_from([0.0, -1.0, 1e308])}),
    "seed": (st.integers(-INT64, INT64 - 1), {"int": edge_int}),
    "stop": (
        st.one_of(word, words),
        {
            "surrogate": st.one_of(surrogate, plus(words, surrogate)),
            "size": st.sampled_from([[""], [str(i) for i in range(50)], ["x" * 5000]]),
        },
    ),
    "stop_token_ids": (
        st.lists(token, max_size=4),
        {
            "id": plus(st.lists(token, max_size=3), edge_int),
            "size": st.just(list(range(VOCAB)) * 3),
        },
    ),
    "logit_bias": (
        st.dictionaries(token.map(str), st.floats(-100, 100), max_size=4),
        {
            "id": st.dictionaries(edge_int.map(str), st.floats(-100, 100), min_size=1, max_size=1),
            "int": st.dictionaries(
                token.map(str), st.sampled_from([-101.0, 1e308]), min_size=1, max_size=1
            ),
            "surrogate": st.dictionaries(surrogate, st.just(1.0), min_size=1, max_size=1),
            "size": st.just({str(i % VOCAB): 1.0 for i in range(5000)}),
        },
    ),
    "allowed_token_ids": (tokens, {"id": plus(tokens, edge_int), "size": st.just([])}),
    "bad_words": (
        st.lists(word, max_size=2),
        {"surrogate": plus(st.lists(word, max_size=1), surrogate), "size": st.just([""])},
    ),
    "min_tokens": (st.integers(0, 4), {"int": edge_int}),
    "ignore_eos": (st.booleans(), {}),
    "include_stop_str_in_output": (st.booleans(), {}),
    "skip_special_tokens": (st.booleans(), {}),
    "priority": (
        st.one_of(st.integers(-10, 10), st.sampled_from([-INT64, INT64 - 1])),
        {"int": edge_int},
    ),
    "truncate_prompt_tokens": (st.integers(1, 20), {"int": edge_int}),
    "stream_options": (
        st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
        {},
    ),
    "user": (st.text(max_size=10), {"surrogate": surrogate}),
    # Beam search refuses most sampling fields: set often enough to meet them.
    "use_beam_search": (st.booleans(), {}),
    "best_of": (st.integers(1, 4), {"int": edge_int}),
    "length_penalty": (st.floats(-2, 2), {"int": st.sampled_from([1e308, -1e308])}),
    "early_stopping": (st.sampled_from([True, False, "never"]), {"junk": st.just("soon")}),
}
COMPLETION = {
    **SAMPLING,
    "prompt": (
        st.one_of(word, words, tokens, st.lists(tokens, min_size=1, max_size=3)),
        {
            "surrogate": st.one_of(surrogate, plus(words, surrogate)),
            "id": st.one_of(
                plus(tokens, edge_int), st.lists(plus(tokens, edge_int), min_size=1, max_size=2)
            ),
            "size": st.sampled_from(["", [], [[]], [7] * 600, ["a"] * 300]),
        },
    ),
    "max_tokens": (st.integers(1, 8), {"int": edge_int}),
    "logprobs": (st.integers(0, 5), {"int": edge_int}),
    "prompt_logprobs": (st.integers(0, 5), {"int": edge_int}),
    "echo": (st.booleans(), {}),
}
CHAT = {
    **SAMPLING,
    "messages": (
        messages,
        {
            "surrogate": plus(st.lists(message, max_size=2), message_with(surrogate)),
            "size": st.sampled_from([[], [{"role": "user", "content": "fox " * 600}]]),
            "junk": plus(st.lists(message, max_size=1), st.one_of(message_with(junk), junk)),
        },
    ),
    "max_tokens": (st.integers(1, 8), {"int": edge_int}),
    "max_completion_tokens": (st.integers(1, 8), {"int": edge_int}),
    "logprobs": (st.booleans(), {}),
    "top_logprobs": (st.integers(0, 5), {"int": edge_int}),
    "add_generation_prompt": (st.booleans(), {}),
    "chat_template_kwargs": (
        st.dictionaries(st.sampled_from(["a", "b"]), st.text(max_size=5), max_size=2),
        {
            "surrogate": st.dictionaries(st.just("x"), surrogate, min_size=1),
            "junk": st.just({"tokenize": True}),
        },
    ),
    "response_format": (
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        {"junk": st.just({"type": "yaml"})},
    ),
}
TOKENIZE = {
    "prompt": (word, {"surrogate": surrogate, "size": st.just("")}),
    "messages": (
        messages,
        {"surrogate": plus(st.lists(message, max_size=1), message_with(surrogate))},
    ),
    "add_special_tokens": (st.booleans(), {}),
}
DETOKENIZE = {
    "tokens": (
        st.lists(token, max_size=8),
        {"id": plus(tokens, edge_int), "size": st.just([1] * 10_000)},
    )
}
text_blocks = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": word}), min_size=1, max_size=2
)
anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(word, text_blocks)}
)
anthropic_messages = st.lists(anthropic_message, min_size=1, max_size=3).map(
    lambda ms: [{**ms[0], "role": "user"}, *ms[1:]]
)
ANTHROPIC_MESSAGES = {  # Anthropic's /v1/messages
    "model": (st.just("tiny"), {"surrogate": surrogate}),
    "messages": (
        anthropic_messages,
        {
            "surrogate": plus(anthropic_messages, st.just({"role": "user", "content": "\ud800"})),
            "size": st.sampled_from([[], [{"role": "user", "content": "fox " * 600}]]),
            "junk": plus(anthropic_messages, junk),
        },
    ),
    "max_tokens": (st.integers(1, 8), {"int": edge_int}),
    "system": (st.one_of(word, text_blocks), {"surrogate": surrogate}),
    "temperature": (st.floats(0, 1), {"int": st.sampled_from([-0.5, 1e308])}),
    "top_p": (st.floats(0.01, 1), {"int": st.sampled_from([0.0, 1.5, -1.0])}),
    "top_k": (st.integers(1, 50), {"int": edge_int}),
    "stop_sequences": (
        st.lists(word, max_size=2),
        {"surrogate": plus(words, surrogate), "size": st.just([str(i) for i in range(50)])},
    ),
    "metadata": (
        st.fixed_dictionaries({"user_id": word}),
        {"surrogate": st.fixed_dictionaries({"user_id": surrogate})},
    ),
}
input_items = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": word}),
    min_size=1,
    max_size=2,
)
RESPONSES = {  # OpenAI's /v1/responses
    "model": (st.just("tiny"), {"surrogate": surrogate}),
    "input": (
        st.one_of(word, input_items),
        {
            "surrogate": st.one_of(
                surrogate, plus(input_items, st.just({"role": "user", "content": "\udfff"}))
            ),
            "size": st.sampled_from(["", [], "fox " * 600]),
            "junk": plus(input_items, junk),
        },
    ),
    "instructions": (word, {"surrogate": surrogate}),
    "max_output_tokens": (st.integers(1, 8), {"int": edge_int}),
    "temperature": (st.floats(0, 2), {"int": st.sampled_from([-0.5, 1e308])}),
    "top_p": (st.floats(0.01, 1), {"int": st.sampled_from([0.0, 1.5])}),
    "store": (st.booleans(), {}),
    "text": (
        st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
        {"junk": st.just({"format": {"type": "xml"}})},
    ),
    "previous_response_id": (st.sampled_from(["resp_missing"]), {"surrogate": surrogate}),
}
ROUTES = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/v1/messages": ANTHROPIC_MESSAGES,
    "/v1/responses": RESPONSES,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}
REQUIRED = {
    "/v1/completions": ["prompt"],
    "/v1/chat/completions": ["messages"],
    "/v1/messages": ["messages", "max_tokens"],
    "/v1/responses": ["input", "max_output_tokens"],
    "/detokenize": ["tokens"],
}
KINDS = ["none", "surrogate", "id", "int", "size", "junk", "unknown", "missing"]


@st.composite
def requests(draw):
    """(route, body): plausible in every field, then (by kind of edge, each about as
    often) one field at or past an edge, an unknown field, or a required one missing."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    spec = ROUTES[route]
    required = REQUIRED.get(route, [])
    body = {name: draw(spec[name][0]) for name in required}
    for name in draw(st.lists(st.sampled_from(sorted(spec)), max_size=12, unique=True)):
        body[name] = draw(spec[name][0])
    if route == "/tokenize" and "prompt" in body and draw(st.booleans()):
        body.pop("messages", None)
    if route.startswith("/v1"):
        body["stream"] = draw(st.booleans())
    kind = draw(st.sampled_from(KINDS))
    if kind == "unknown":
        body[draw(st.sampled_from(["frobnicate", "best_of_luck", "logit-bias"]))] = draw(junk)
    elif kind == "missing" and required:
        del body[required[0]]
    elif kind == "junk":
        name = draw(st.sampled_from(sorted(spec)))
        body[name] = draw(spec[name][1].get("junk", junk))
    elif kind != "none":
        fields = sorted(name for name, (_, edges) in spec.items() if kind in edges)
        if fields:
            name = draw(st.sampled_from(fields))
            body[name] = draw(spec[name][1][kind])
    return route, body


EXAMPLES = int(os.environ.get("PAGODA_FUZZ_EXAMPLES", "600"))


def sse_types(r: httpx.Response) -> list[str]:
    """The `type` of each SSE event's data (Anthropic's and the Responses API's streams)."""
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return [json.loads(d)["type"] for d in data]


def check_answer(r: httpx.Response, body: dict, route: str) -> None:
    """2xx with a well-formed body, or 4xx with the API's own error body; never 5xx."""
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400 and route == "/v1/messages":  # Anthropic's error body
        error = r.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        assert error["error"]["type"].endswith("_error") and error["error"]["message"]
        return
    if r.status_code >= 400:
        assert_error(r)
        return
    if body.get("stream") is True and route in ("/v1/messages", "/v1/responses"):
        kinds = sse_types(r)
        assert "error" not in kinds and "response.failed" not in kinds, (kinds, body)
        last = {"message_stop"} if route == "/v1/messages" else {"response.completed", "response.incomplete"}  # fmt: skip
        assert kinds[-1] in last, (kinds, body)
    elif body.get("stream") is True:
        lines = [line for line in r.text.split("\n\n") if line]
        assert lines[-1] == "data: [DONE]", r.text[-300:]
        for line in lines[:-1]:
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, (event, body)  # every check ran before the 200
    else:
        r.json()


@pytest.mark.slow
def test_fuzz_http_api(server):
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize="PAGODA_FUZZ_EXAMPLES" not in os.environ,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(requests())
    def one_request(route_and_body):
        route, body = route_and_body
        check_answer(post(server, route, body), body, route)

    one_request()
    assert_serves(server)  # /health 200, a normal request runs, 0 KV blocks in use
