"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the
chat completions path.

A Messages body becomes a chat completions request (`to_chat_request`): `system`
the system message, `tool_use` blocks an assistant's `tool_calls`, `tool_result`
blocks `tool` messages, images `image_url` parts, `tools`/`tool_choice` OpenAI's,
`stop_sequences` `stop`. It then runs exactly as /v1/chat/completions runs it (the
same prompt, the same grammar forcing a call, the same call parser), so greedy
replies are the same text. Only the response differs: content blocks, Anthropic's
stop reasons, and its stream events (`message_start`, `content_block_start`,
`content_block_delta` with `text_delta` or `input_json_delta`,
`content_block_stop`, `message_delta` with the stop reason and usage,
`message_stop`).

Errors are Anthropic's body `{"type": "error", "error": {"type", "message"}}`
(`AnthropicErrors` rewrites OpenAI's on these routes), in a stream an `error` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pagoda.engine.call_stream import CallDelta
from pagoda.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    ImageBlock,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from pagoda.entrypoints.openai.errors import (
    APIError,
    bad_request,
    failure_to_api_error,
    renamed,
    validated,
)
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagoda.errors import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)

# The chat request's field names, as a Messages body names them.
_RENAMES = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice",
    "user": "metadata",
    "response_format": "output_config",
}


# ---- the request ------------------------------------------------------------------


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def _image_part(block: ImageBlock, where: str) -> dict:
    source = block.source
    if source.type == "base64":
        if not source.media_type or source.data is None:
            raise bad_request(f"{where}.source: base64 needs media_type and data.", "messages")
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        if not source.url:
            raise bad_request(f"{where}.source: url needs url.", "messages")
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_message(block: ToolResultBlock, where: str) -> dict:
    parts = block.content if isinstance(block.content, list) else [block.content]
    if any(isinstance(p, ImageBlock) for p in parts):
        raise bad_request(
            f"{where}.content: images in a tool_result are not supported.", "messages"
        )
    text = "".join(p if isinstance(p, str) else p.text for p in parts)
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


# Blocks a message of that role cannot hold.
_WRONG_ROLE = {ToolUseBlock: "user", ToolResultBlock: "assistant", ImageBlock: "assistant"}


def conversation(req: CountTokensRequest) -> list[dict]:
    """The body's system prompt and messages as chat completions messages."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict] = []
        calls: list[dict] = []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if _WRONG_ROLE.get(type(block)) == message.role:
                raise bad_request(
                    f"{where}: a {message.role} message has no {block.type} block.", "messages"
                )
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(_image_part(block, where))
            elif isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, ensure_ascii=False)
                function = {"name": block.name, "arguments": arguments}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif isinstance(block, ToolResultBlock):
                out.append(_tool_message(block, where))
            # thinking blocks of earlier turns stay out of the prompt
        if message.role == "assistant":
            text = "".join(p["text"] for p in parts)
            entry = {"role": "assistant", "content": text or None}
            if calls:
                entry["tool_calls"] = calls
            if text or calls:
                out.append(entry)
        elif parts:
            out.append({"role": "user", "content": parts})
    return out


def openai_tools(req: CountTokensRequest) -> list[dict] | None:
    if not req.tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description is not None else {}),
                "parameters": t.input_schema,
            },
        }
        for t in req.tools
    ]


def _tool_choice(req: CountTokensRequest) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for the body's tool_choice."""
    choice = req.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice: type 'tool' needs the tool's name.", "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _template_kwargs(req: CountTokensRequest, reasoning: bool) -> dict | None:
    """`thinking` as the chat template takes it: "disabled" turns a thinking template's
    `enable_thinking` off; "enabled" needs a reasoning parser (--reasoning-parser)."""
    kind = req.thinking.type if req.thinking is not None else None
    if kind == "enabled" and not reasoning:
        raise bad_request(
            "thinking: this server has no reasoning parser (start it with --reasoning-parser).",
            "thinking",
        )
    return {"enable_thinking": False} if kind == "disabled" else None


def to_chat_request(req: MessagesRequest, reasoning: bool = False) -> ChatCompletionRequest:
    """The chat completions request that runs a Messages body (`reasoning`: the server
    has a reasoning parser)."""
    tool_choice, parallel = _tool_choice(req)
    if tool_choice is not None and not req.tools:
        raise bad_request("tool_choice needs tools.", "tool_choice")
    return validated(
        ChatCompletionRequest,
        _RENAMES,
        model=req.model,
        messages=conversation(req),
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        user=req.metadata.user_id if req.metadata else None,
        tools=openai_tools(req),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=_response_format(req),
        chat_template_kwargs=_template_kwargs(req, reasoning),
    )


def _response_format(req: MessagesRequest) -> dict | None:
    """`output_config.format` (structured outputs) as OpenAI's response_format."""
    fmt = req.output_config.format if req.output_config else None
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}


# ---- the response -----------------------------------------------------------------


def stop_reason(finish_reason: str | None, stop: int | str | None, num_calls: int) -> str:
    """Anthropic's stop reason for an output that finished so."""
    if finish_reason == "abort":
        raise APIError(503, "the request was aborted: the server is stopping.", "overloaded_error")
    if finish_reason == "length":
        return "max_tokens"
    if num_calls:
        return "tool_use"
    return "stop_sequence" if isinstance(stop, str) else "end_turn"


def _tool_use(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}


def event(kind: str, body: dict) -> str:
    """One server-sent event as Anthropic names them."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


# A streamed block's start and delta, by kind: a thinking or a text block.
_BLOCKS = {
    "thinking": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta"),
    "text": ({"type": "text", "text": ""}, "text_delta"),
}


class StreamBlocks:
    """A stream's content blocks: a thinking block (with a reasoning parser), then text
    blocks opened by text and closed by a call or the end, each call a tool_use block
    whose input streams in pieces of its JSON text."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the block open now

    def add(self, kind: str, text: str) -> list[str]:
        """Events for `text` of block `kind` ("thinking" or "text")."""
        if not text:
            return []
        out = []
        start, delta_type = _BLOCKS[kind]
        if self.open != kind:
            out = self.close()
            self.index += 1
            self.open = kind
            out.append(event("content_block_start", {"index": self.index, "content_block": start}))
        delta = {"type": delta_type, kind: text}
        return [*out, event("content_block_delta", {"index": self.index, "delta": delta})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def tool_use(self, call: CallDelta) -> list[str]:
        """Events for a piece of a call: its block opens with its name, its input streams."""
        out = []
        if call.id is not None:
            out = self.close()
            self.index += 1
            self.open = "tool_use"
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            out.append(event("content_block_start", {"index": self.index, "content_block": block}))  # fmt: skip
        if call.arguments:
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return out + (self.close() if call.done else [])


class ServingMessages:
    """The Messages routes, on the server's chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.abort_unfinished = chat.abort_unfinished
        self.reasoning = chat.engine.model_config.reasoning_parser is not None

    async def start(
        self, req: MessagesRequest, trace_headers: Mapping[str, str] | None = None
    ) -> ChatRun:
        try:
            chat_req = to_chat_request(req, self.reasoning)
            return await self.chat.start(chat_req, trace_headers)
        except APIError as e:
            raise renamed(e, _RENAMES) from None

    async def full_response(self, run: ChatRun) -> MessageResponse:
        response = await self.chat.full_response(run)
        (choice,) = response.choices
        message = choice.message
        content = []
        if message.reasoning:
            content.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls:
            content.append(_tool_use(call.id, call.function.name, call.function.arguments))
        stop = choice.stop_reason
        return MessageResponse(
            id=_message_id(run),
            model=run.model,
            content=content,
            stop_reason=stop_reason(choice.finish_reason, stop, len(message.tool_calls)),
            stop_sequence=stop if isinstance(stop, str) else None,
            usage=Usage(
                input_tokens=response.usage.prompt_tokens,
                output_tokens=response.usage.completion_tokens,
            ),
        )

    async def stream_response(self, run: ChatRun) -> AsyncIterator[str]:
        blocks = StreamBlocks()
        num_tokens = num_calls = 0
        start = MessageResponse(
            id=_message_id(run),
            model=run.model,
            content=[],
            usage=Usage(input_tokens=run.stream.num_prompt_tokens, output_tokens=0),
        )
        try:
            yield event("message_start", {"message": start.model_dump()})
            yield event("ping", {})
            async for thought, text, calls, delta in self.chat.parsed_deltas(run):
                num_tokens += len(delta.token_ids)
                for piece in [*blocks.add("thinking", thought), *blocks.add("text", text)]:
                    yield piece
                for call in calls:
                    num_calls += call.id is not None
                    for piece in blocks.tool_use(call):
                        yield piece
                if delta.finish_reason is None:
                    continue
                for piece in blocks.close():
                    yield piece
                stop = delta.stop_reason
                reason = stop_reason(delta.finish_reason, stop, num_calls)
                final = {
                    "stop_reason": reason,
                    "stop_sequence": stop if reason == "stop_sequence" else None,
                }
                yield event(
                    "message_delta", {"delta": final, "usage": {"output_tokens": num_tokens}}
                )
                yield event("message_stop", {})
        except (RequestFailedError, EngineDeadError, APIError) as e:  # APIError: aborted
            logger.error("messages stream %s failed: %s", run.response_id, e)
            error = e if isinstance(e, APIError) else failure_to_api_error(e)
            body = {"type": error_type(error.status_code), "message": error.message}
            yield event("error", {"error": body})
        finally:
            self.chat.abort_unfinished([run.stream])

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        self.chat.check_model(req.model)
        kwargs = _template_kwargs(req, self.reasoning)
        messages = conversation(req)
        await self.chat.fetch_images(messages)
        processor = self.chat.processor
        _, tokens, _ = await self.chat.engine.run_in_processor(
            processor.render_chat, messages, True, kwargs, openai_tools(req)
        )
        return CountTokensResponse(input_tokens=len(tokens))


def _message_id(run: ChatRun) -> str:
    return "msg_" + run.response_id.removeprefix("chatcmpl-")


# ---- errors -----------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


class AnthropicErrors:
    """On /v1/messages routes, every error body (the routes', validation's, the API
    key's, the body limit's) in Anthropic's shape instead of OpenAI's."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/messages"):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body = b""

        async def rewriting_send(message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is whole
                return
            if start is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            new_body = _anthropic_error(start["status"], body)
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body})

        await self.app(scope, receive, rewriting_send)


def _anthropic_error(status: int, body: bytes) -> bytes:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    error = {"type": error_type(status), "message": message}
    return json.dumps({"type": "error", "error": error}, ensure_ascii=False).encode()
