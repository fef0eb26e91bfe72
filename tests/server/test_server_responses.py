"""OpenAI's Responses API (/v1/responses) through `pagoda serve`, driven by the official
`openai` client and checked against /v1/chat/completions on the same conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagoda.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagoda.entrypoints.openai.serving_responses import conversation
from tests.helpers import RemoteServer, make_model

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER_SCHEMA}  # fmt: skip
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
PROMPT = "Hello world, how are you today?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model(str(tmp_path_factory.mktemp("m")), "llama", max_position_embeddings=2048)
    with RemoteServer(model, "--served-model-name", "tiny", "--max-stored-responses", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def create(client, **kwargs):
    kwargs = {"model": "tiny", "input": PROMPT, "max_output_tokens": 24, "temperature": 0, **kwargs}
    return client.responses.create(**kwargs)


def chat(client, messages, **kwargs):
    kwargs = {"model": "tiny", "max_tokens": 24, "temperature": 0, **kwargs}
    return client.chat.completions.create(messages=messages, **kwargs)


def test_reply_is_the_chat_completion(client):
    response = create(client, instructions="Be terse.")
    expected = chat(client, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": PROMPT}])  # fmt: skip
    choice = expected.choices[0]
    assert response.output_text == choice.message.content
    assert response.id.startswith("resp_") and response.object == "response"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens
    assert response.usage.total_tokens == expected.usage.total_tokens
    assert response.instructions == "Be terse." and response.max_output_tokens == 24


def test_stream_is_the_whole_reply_in_order(client):
    whole = create(client)
    events = list(create(client, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-1] == {"completed": "response.completed", "incomplete": "response.incomplete"}[whole.status]  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_previous_response_id_continues_the_conversation(client):
    first = create(client, input="Hi there")
    second = create(client, input="And then?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    expected = chat(client, messages)
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    # Stored: GET gives it back; DELETE removes it; a miss is a 404 naming the id.
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    for ask in (
        lambda: client.responses.retrieve(first.id),
        lambda: create(client, previous_response_id=first.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            ask()
        assert first.id in e.value.message
    unstored = create(client, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_function_call_round_trip(client):
    choice = {"type": "function", "name": "get_weather"}
    response = create(client, max_output_tokens=150, tools=[WEATHER], tool_choice=choice)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    events = list(create(client, max_output_tokens=150, tools=[WEATHER], tool_choice=choice, stream=True))  # fmt: skip
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert done.arguments == "".join(pieces) == call.arguments and done.name == call.name
    assert len(pieces) > 3  # the arguments stream as the model writes them
    # The result goes back as the next input, on top of the stored response.
    follow = create(
        client,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        tools=[WEATHER],
    )
    assert follow.status in ("completed", "incomplete")
    expected = chat(
        client,
        [
            {"role": "user", "content": PROMPT},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }  # fmt: skip
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
        ],
        tools=[CHAT_WEATHER],
    )
    assert follow.usage.input_tokens == expected.usage.prompt_tokens
    assert follow.output_text == (expected.choices[0].message.content or "")


def test_text_format_json_schema(client):
    schema = {**WEATHER_SCHEMA, "properties": {**WEATHER_SCHEMA["properties"], "city": {"enum": ["Oslo", "Rome"]}}}  # fmt: skip
    fmt = {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
    response = create(client, max_output_tokens=60, text={"format": fmt})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_input_items():
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "see"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
        ]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}, {"type": "refusal", "refusal": "!"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "id": "r", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]  # fmt: skip
    assert conversation(items) == [
        {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        ]},
        {"role": "assistant", "content": "ok!", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]  # fmt: skip


def test_store_limits(monkeypatch):
    store = ResponseStore(max_size=2, ttl_s=10)
    for name in "abc":
        store.put(name, StoredResponse({"id": name}, []))
    with pytest.raises(Exception, match="'a' not found"):
        store.get("a")  # the oldest went first
    assert store.get("c").body == {"id": "c"}
    clock = store.get("b").stored_at
    monkeypatch.setattr("time.monotonic", lambda: clock + 11)
    with pytest.raises(Exception, match="'b' not found"):
        store.get("b")  # expired
    with pytest.raises(ValueError, match="max_stored_responses"):
        ResponseStore(max_size=-1)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "frequency": 1}, "frequency"),
    ],
)
def test_errors_are_openai_bodies(server, body, param):
    r = httpx.post(server.base_url + "/responses", json={"model": "tiny", **body})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(server.url + "/health").status_code == 200
