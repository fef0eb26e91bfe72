"""Anthropic's Messages API (/v1/messages) through `pagoda serve`, driven by the official
`anthropic` client and checked against /v1/chat/completions on the same prompt."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from pagoda.entrypoints.anthropic.protocol import MessagesRequest
from pagoda.entrypoints.anthropic.serving import to_chat_request
from tests.helpers import RemoteServer, make_model

KEY = "sk-messages-test"
SYSTEM = "You are terse."
USER = [{"role": "user", "content": "Hello world, how are you today?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model(str(tmp_path_factory.mktemp("m")), "llama", max_position_embeddings=2048)
    with RemoteServer(model, "--served-model-name", "tiny", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


GREEDY = {"temperature": 0}  # the newest SDKs send no temperature of their own


def create(client, **kwargs):
    kwargs = {"model": "tiny", "max_tokens": 24, "messages": USER, "extra_body": GREEDY, **kwargs}
    return client.messages.create(**kwargs)


def test_reply_is_the_chat_completion(client, openai_client):
    message = create(client, system=SYSTEM)
    chat = openai_client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, *USER],
        max_tokens=24,
        temperature=0,
    )
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=USER)
    assert counted.input_tokens == message.usage.input_tokens


def test_stream_is_the_whole_reply_in_anthropic_events(client, server):
    whole = create(client, system=SYSTEM)
    with client.messages.stream(
        model="tiny", max_tokens=24, extra_body=GREEDY, system=SYSTEM, messages=USER
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage == whole.usage
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    # The SDK adds its own "text" events beside the wire's deltas; the wire order:
    wire = [k for k in kinds if k not in ("text", "ping")]
    assert wire[1] == "content_block_start" and wire[-3] == "content_block_stop"
    assert set(wire[2:-3]) == {"content_block_delta"}


def test_stop_sequences(client):
    text = create(client, max_tokens=24).content[0].text
    words = text.split()
    assert len(words) > 3, text
    stop = words[2]
    message = create(client, max_tokens=24, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


def test_forced_tool_use_and_its_result(client, openai_client):
    choice = {"type": "tool", "name": "get_weather"}
    message = create(client, max_tokens=150, tools=[WEATHER], tool_choice=choice)
    assert message.stop_reason == "tool_use", message
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with client.messages.stream(
        model="tiny", max_tokens=150, extra_body=GREEDY, messages=USER, tools=[WEATHER],
        tool_choice=choice,
    ) as stream:  # fmt: skip
        kinds = [(e.type, getattr(e, "delta", None)) for e in stream]
        streamed = stream.get_final_message()
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    # The input streams as the model writes it, in several input_json_delta events.
    pieces = [d.partial_json for k, d in kinds if k == "content_block_delta" and d.type == "input_json_delta"]  # fmt: skip
    assert len(pieces) > 3 and json.loads("".join(pieces)) == call.input
    assert streamed_call.input == call.input and streamed.stop_reason == "tool_use"
    # The call and its result go back as the next turn: the same prompt chat builds.
    turn = [
        *USER,
        {"role": "assistant", "content": [c.model_dump() for c in message.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    reply = create(client, max_tokens=8, messages=turn, tools=[WEATHER])
    assert reply.role == "assistant"
    chat = openai_client.chat.completions.create(
        model="tiny",
        max_tokens=8,
        temperature=0,
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
            {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather",
                    "parameters": WEATHER_SCHEMA,
                },
            }
        ],  # fmt: skip
    )
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def test_output_config_format_is_structured_output(client):
    schema = {**WEATHER_SCHEMA, "properties": {**WEATHER_SCHEMA["properties"], "city": {"enum": ["Oslo", "Rome"]}}}  # fmt: skip
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    message = create(client, max_tokens=60, output_config=config)
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_translation():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "boom"}],
                            "is_error": True,
                        },  # fmt: skip
                    ],
                },
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u"},
        }
    )
    chat = to_chat_request(req)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "ab"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            ],
        },
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"},
    ]
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.user == "u" and chat.max_tokens == 5


@pytest.mark.parametrize(
    "body, status, kind, words",
    [
        ({"messages": USER}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 5, "messages": USER, "best_of": 2}, 400, "invalid_request_error", "best_of"),
        ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages"),
        ({"max_tokens": 0, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 5, "messages": USER, "model": "nope"}, 404, "not_found_error", "nope"),
        (
            {"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 9}},
            400, "invalid_request_error", "thinking",
        ),
        (
            {"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}},
            400, "invalid_request_error", "tool_choice",
        ),
        (
            {"max_tokens": 5, "messages": USER, "stop_sequences": [""]},
            400, "invalid_request_error", "stop_sequences",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
            },
            400, "invalid_request_error", "tool_use",
        ),
    ],
)  # fmt: skip
def test_errors_are_anthropic_bodies(server, body, status, kind, words):
    body = {"model": "tiny", **body}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"], error


def test_api_key(server, client):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        create(bad)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert create(client, max_tokens=2).usage.output_tokens <= 2  # the server serves on
