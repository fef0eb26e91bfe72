"""Reasoning output (--reasoning-parser): the <think> block split from the answer in
chat completions, Anthropic's Messages and OpenAI's Responses, streamed and whole;
grammars that start after the block. A tiny model whose chat template opens
`<think>` (or closes it at once with `enable_thinking: false`, as Qwen3's does)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from pagoda.engine.reasoning import ReasoningParser, prompt_state
from tests.helpers import RemoteServer, make_model, make_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hello world, how are you today?"}]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize(
    "prompt, text, reasoning, answer",
    [
        ("<|assistant|><think>\n", "let me see</think>\n\nIt is 4.", "let me see", "It is 4."),
        ("<|assistant|><think>\n", "no end in sight", "no end in sight", ""),
        (
            "<think>\n\n</think>\n\n",
            "plain <think>answer</think>",
            "",
            "plain <think>answer</think>",
        ),
        ("<|assistant|>", "  <think>hmm</think>yes", "hmm", "yes"),
        ("<|assistant|>", "<thin", "", "<thin"),
        ("<|assistant|>", "straight away", "", "straight away"),
        ("<|assistant|>", "<think>a</thi", "a</thi", ""),
    ],
)
def test_parser_streams_as_it_parses_whole(prompt, text, reasoning, answer):
    for size in (1, 3, 7, len(text)):
        parser, got = ReasoningParser(prompt), ["", ""]
        for i in range(0, len(text), size):
            r, a = parser.feed(text[i : i + size])
            got = [got[0] + r, got[1] + a]
        r, a = parser.finish()
        assert [got[0] + r, got[1] + a] == [reasoning, answer], size
    assert prompt_state(None) == "start"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("think"))
    vocab = len(make_tokenizer(str(tmp_path_factory.mktemp("size"))))
    make_model(folder, "llama", max_position_embeddings=2048, vocab_size=vocab + 2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"])  # one token each, as Qwen3 has them
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    with RemoteServer(folder, "--served-model-name", "tiny", "--reasoning-parser", "qwen3") as s:
        s.end_id = end_id
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, stream=False, **kwargs):
    kwargs = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 16, **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


def streamed(chunks) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    return reasoning, content


def raw_completion(client, server, messages, **kwargs) -> str:
    """The model's text for the chat's prompt, unparsed (through /v1/completions)."""
    extra = kwargs.pop("extra_body", {})
    body = {"messages": messages, **extra}
    tokens = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    out = client.completions.create(
        model="tiny", prompt=tokens, temperature=0, max_tokens=16, **kwargs
    )
    return out.choices[0].text


def test_reasoning_and_answer_are_split_and_streamed_equal(client, server):
    # The prompt opened the block; the model writes some of it, then (pushed by
    # logit_bias) closes it: what comes before is reasoning, after it the answer.
    whole = chat(client).choices[0].message
    raw = raw_completion(client, server, MESSAGES)
    assert whole.reasoning == whole.reasoning_content == raw and whole.content == ""
    bias = {str(server.end_id): 100}
    whole = chat(client, logit_bias=bias).choices[0].message
    raw = raw_completion(client, server, MESSAGES, logit_bias=bias)
    assert raw.startswith("</think>")
    assert whole.reasoning == "" or whole.reasoning is None
    assert whole.content == raw[len("</think>") :].lstrip("\n")
    for kwargs in ({}, {"logit_bias": bias}):
        message = chat(client, **kwargs).choices[0].message
        assert streamed(chat(client, stream=True, **kwargs)) == (
            message.reasoning or "",
            message.content or "",
        )


def test_grammar_constrains_the_answer_not_the_reasoning(client, server):
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    bias = {str(server.end_id): 100}
    # Open block: the first token may close it (no mask yet); then the schema holds.
    message = chat(client, response_format=rf, logit_bias=bias, max_tokens=40).choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    # Thinking off (the template closed the block): the grammar holds from the first
    # token, so the pushed </think> is never sampled.
    message = (
        chat(client, response_format=rf, logit_bias=bias, max_tokens=40, extra_body=NO_THINKING)
        .choices[0]
        .message
    )
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert not message.reasoning


def test_thinking_off_is_all_answer(client, server):
    message = chat(client, extra_body=NO_THINKING).choices[0].message
    assert message.content == raw_completion(client, server, MESSAGES, extra_body=NO_THINKING)
    assert not message.reasoning


def test_messages_thinking_blocks(client, server):
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    kwargs = {"model": "tiny", "max_tokens": 16, "messages": MESSAGES, "extra_body": {"temperature": 0}}  # fmt: skip
    message = anthropic_client.messages.create(**kwargs)
    expected = chat(client).choices[0].message
    (block,) = message.content
    assert block.type == "thinking" and block.thinking == expected.reasoning
    with anthropic_client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    off = anthropic_client.messages.create(**kwargs, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == chat(client, extra_body=NO_THINKING).choices[0].message.content


def test_responses_reasoning_items(client):
    kwargs = {"model": "tiny", "input": MESSAGES[0]["content"], "max_output_tokens": 16, "temperature": 0}  # fmt: skip
    response = client.responses.create(**kwargs)
    (item,) = response.output
    assert item.type == "reasoning"
    assert item.content[0].text == chat(client).choices[0].message.reasoning
    events = list(client.responses.create(**kwargs, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text
    assert [i.type for i in events[-1].response.output] == ["reasoning"]
    off = client.responses.create(**kwargs, reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"]
