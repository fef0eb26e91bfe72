"""Tool-call parsers (--tool-call-parser hermes|llama3_json|mistral|pythonic): each
format's text fed in 1-, 3- and 7-character pieces parses as it does whole; forced
calls in each format through `pagoda serve`, in chat, Responses and Messages."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import llguidance
import llguidance.hf
import pytest

from pagoda.engine.call_stream import merge_calls
from pagoda.engine.tool_parsers import forced_call_grammar, make_tool_parser
from pagoda.errors import InvalidRequestError
from tests.helpers import RemoteServer, make_model, make_tokenizer

NAMES = ["get_weather", "get_time"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
W = {"city": "Oslo"}

CASES = [
    # (parser, text, content, calls as (name, arguments))
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "Sure.", [("get_weather", W)]),
    ("hermes", "no calls <tool_ here", "no calls <tool_ here", []),
    ("hermes", "a \n\n<tool_call>{no}</tool_call> b", "a \n\n<tool_call>{no}</tool_call> b", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}', "", [("get_weather", W), ("get_time", {})]),
    ("llama3_json", "Just text {not json", "Just text {not json", []),
    ("llama3_json", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]', "Let me check.", [("get_weather", W), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "", [("get_weather", W)]),
    ("mistral", "[TOOL_CALLS]broken", "[TOOL_CALLS]broken", []),
    ("mistral", "a [TOOL plain", "a [TOOL plain", []),
    ("pythonic", '[get_weather(city="Oslo"), get_time()]', "", [("get_weather", W), ("get_time", {})]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
    ("pythonic", "<|python_start|>[get_weather(city='Oslo')]<|python_end|>", "", [("get_weather", W)]),
]  # fmt: skip


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_pieces_parse_as_the_whole(parser, text, content, calls):
    """The same content and calls in any pieces; the arguments of a JSON call go out in
    pieces as they are written (at least one per character fed), adding up to exactly
    the whole parse's text; pythonic calls go out whole."""
    runs = {}
    for size in (len(text), 1, 3, 7):
        p, got_content, deltas = make_tool_parser(parser, NAMES), "", []
        for i in range(0, len(text), size):
            c, new = p.feed(text[i : i + size])
            got_content, deltas = got_content + c, deltas + new
        c, new = p.finish()
        got_content, deltas = got_content + c, deltas + new
        got_calls = merge_calls(deltas)
        assert got_content == content, size
        assert [(k.name, json.loads(k.arguments)) for k in got_calls] == calls, size
        assert [d.index for d in deltas if d.id] == list(range(len(calls)))
        assert [d.index for d in deltas if d.done] == list(range(len(calls)))
        runs[size] = (got_calls, deltas)
    for size, (got_calls, deltas) in runs.items():
        assert [c.arguments for c in got_calls] == [c.arguments for c in runs[len(text)][0]]
        if size == 1 and parser != "pythonic":
            for call in got_calls:
                pieces = [d for d in deltas if d.index == got_calls.index(call) and d.arguments]
                assert len(pieces) == len(call.arguments) or len(call.arguments) <= 2


@pytest.fixture(scope="module")
def ll_tokenizer(tmp_path_factory):
    tokenizer = make_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer)), tokenizer


@pytest.mark.parametrize(
    "parser, text",
    [
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ],
)  # fmt: skip
def test_forced_call_grammar_speaks_its_parser_format(ll_tokenizer, parser, text):
    ll, tokenizer = ll_tokenizer
    matcher = llguidance.LLMatcher(ll, forced_call_grammar(parser, TOOLS, None, True, {}))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.consume_token(token), (parser, matcher.get_error())
    assert matcher.is_accepting()
    p = make_tool_parser(parser, NAMES)
    (content, calls), (rest, last) = p.feed(text), p.finish()
    assert not (content + rest).strip() and calls + last
    # A call of the wrong shape is refused by the grammar.
    bad = llguidance.LLMatcher(ll, forced_call_grammar(parser, TOOLS, "get_time", False, {}))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert not all(bad.consume_token(t) for t in ids) or not bad.is_accepting()


def test_pythonic_cannot_force_a_call():
    with pytest.raises(InvalidRequestError, match="pythonic"):
        forced_call_grammar("pythonic", TOOLS, None, False, {})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model(str(tmp_path_factory.mktemp("m")), "llama", max_position_embeddings=2048)
    args = ["--served-model-name", "tiny", "--tool-call-parser", "llama3_json"]
    with RemoteServer(model, *args, "--enable-auto-tool-choice") as s:
        yield s


def test_llama3_json_calls_in_every_api(server):
    client = server.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    common = {"model": "tiny", "temperature": 0, "max_tokens": 60}
    reply = client.chat.completions.create(
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice=choice,
        **common,
    ).choices[0]
    assert reply.finish_reason == "tool_calls"
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    tool = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
    response = client.responses.create(
        model="tiny", input="Weather?", tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    (item,) = response.output
    assert item.type == "function_call" and json.loads(item.arguments) == json.loads(call.function.arguments)  # fmt: skip
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = messages.messages.create(
        model="tiny", max_tokens=60, messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"name": "get_weather", "input_schema": SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0},
    )  # fmt: skip
    (block,) = message.content
    assert block.type == "tool_use" and block.input == json.loads(call.function.arguments)
