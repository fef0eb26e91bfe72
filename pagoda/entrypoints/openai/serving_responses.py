"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over
the chat completions path.

A body becomes a chat completions request: `instructions` the system message,
`input` (a string, or items: messages with `input_text`/`output_text`/`input_image`
parts, `function_call`, `function_call_output`) the conversation, function `tools`
and `tool_choice` OpenAI's chat forms, `text.format` the `response_format`,
`max_output_tokens` `max_tokens`. It runs as /v1/chat/completions runs it (the same
prompt, call grammar and call parser), so a greedy reply is the same text. The
reply's output is a `message` item with `output_text` and one `function_call` item
per call; a stream sends the official events in order, each with its
`sequence_number` (`response.created`, `response.in_progress`, per item
`response.output_item.added`, then `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done` or `response.function_call_arguments.delta` and
`.done`, then `response.output_item.done`; last `response.completed`, or
`response.incomplete` when `max_output_tokens` cut it).

`ResponseStore` keeps stored responses (`store`, default true) in memory, at most
`max_size` for at most `ttl_s` seconds: `previous_response_id` continues one (its
conversation and output come before the new input; its instructions do not, as
OpenAI has it), and a miss is a 404 naming the id.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.entrypoints.openai.errors import (
    APIError,
    bad_request,
    failure_to_api_error,
    renamed,
    validated,
)
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.responses_protocol import ResponsesRequest
from pagoda.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagoda.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagoda.errors import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)

# The chat request's field names, as a Responses body names them.
_RENAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "messages": "input",
}


# ---- the request --------------------------------------------------------------------


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> list[dict]:
    """A message's content as chat parts: text parts, and images where allowed."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts.", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{j}]"
        if kind not in kinds:
            raise bad_request(f"{at}.type must be one of {', '.join(kinds)}.", "input")
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request(f"{at}: an input_image needs image_url (file_id is not served).", "input")  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise bad_request(f"{at}: its text must be a string.", "input")
            parts.append({"type": "text", "text": text})
    return parts


def conversation(items: str | list[dict]) -> list[dict]:
    """The body's `input` as chat completions messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant.", "input")  # fmt: skip
            if role == "assistant":
                parts = _text_of(item.get("content"), where, ("output_text", "input_text", "refusal"))  # fmt: skip
                text = "".join(p.get("text", "") for p in parts)
                out.append({"role": "assistant", "content": text})
            else:
                out.append({"role": role, "content": _text_of(item.get("content"), where, ("input_text", "input_image"))})  # fmt: skip
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs call_id, name and arguments (strings).", "input")  # fmt: skip
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # calls after its text
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs call_id.", "input")
            if not isinstance(output, str):
                output = "".join(p["text"] for p in _text_of(output, where, ("input_text",)))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind != "reasoning":  # earlier reasoning stays out of the prompt
            raise bad_request(
                f"{where}.type {kind!r} is not served (message, function_call, "
                f"function_call_output, reasoning are).",
                "input",
            )
    return out


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """(chat `tools`, chat `tool_choice`) for the body's function tools."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise bad_request(f"tools[{i}].type must be 'function' (built-in tools are not served).", "tools")  # fmt: skip
            fn = {k: v for k, v in tool.items() if k != "type"}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.", "tool_choice")  # fmt: skip
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    return fmt  # json_object, or a type chat refuses naming `text`


# ---- the response -------------------------------------------------------------------


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call_id.removeprefix("call_"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}  # fmt: skip


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}  # fmt: skip


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def assistant_message(output: list[dict]) -> dict:
    """The output items as the chat message that continues the conversation."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {"name": it["name"], "arguments": it["arguments"]},
        }  # fmt: skip
        for it in output
        if it["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass
class ResponsesRun:
    req: ResponsesRequest
    chat: ChatRun
    response_id: str
    created_at: int
    conversation: list[dict]  # what the stored response continues from

    @property
    def streams(self) -> list:
        return self.chat.streams


class ServingResponses:
    """The Responses routes, on the server's chat handler."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat, self.store = chat, store
        self.abort_unfinished = chat.abort_unfinished
        self.reasoning = chat.engine.model_config.reasoning_parser is not None

    async def start(
        self, req: ResponsesRequest, trace_headers: Mapping[str, str] | None = None
    ) -> ResponsesRun:
        self.chat.check_supported(req)
        effort = (req.reasoning or {}).get("effort")
        if effort not in (None, "none") and not self.reasoning:
            raise bad_request(
                "reasoning: this server has no reasoning parser (start it with --reasoning-parser).",
                "reasoning",
            )
        messages = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id, "previous_response_id")
            messages = [dict(m) for m in previous.conversation]
        messages += conversation(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        tools, tool_choice = chat_tools(req)
        chat_req = validated(
            ChatCompletionRequest,
            _RENAMES,
            model=req.model,
            messages=system + messages,
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            priority=req.priority,
            user=req.user,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=response_format(req),
            # effort "none": a thinking chat template's enable_thinking off
            chat_template_kwargs={"enable_thinking": False} if effort == "none" else None,
        )
        try:
            run = await self.chat.start(chat_req, trace_headers)
        except APIError as e:
            raise renamed(e, _RENAMES) from None
        response_id = "resp_" + run.response_id.removeprefix("chatcmpl-")
        return ResponsesRun(req, run, response_id, int(time.time()), messages)

    def body(self, run: ResponsesRun, status: str, output: list[dict], usage=None) -> dict:
        """The response object (OpenAI's fields, the request's settings echoed)."""
        req = run.req
        return {
            "id": run.response_id,
            "object": "response",
            "created_at": run.created_at,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": run.chat.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": {
                "format": (req.text.format if req.text and req.text.format else {"type": "text"})
            },  # fmt: skip
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def finish(self, run: ResponsesRun, finish_reason: str | None, output: list, counts) -> dict:
        """The finished response's object, stored if the body asked."""
        if finish_reason == "abort":
            raise APIError(503, "the request was aborted: the server is stopping.", "ServiceUnavailableError")  # fmt: skip
        status = "incomplete" if finish_reason == "length" else "completed"
        num_in, num_out = counts
        usage = {
            "input_tokens": num_in,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": num_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_in + num_out,
        }
        body = self.body(run, status, output, usage)
        if run.req.store:
            conversation = [*run.conversation, assistant_message(output)]
            self.store.put(run.response_id, StoredResponse(body, conversation))
        return body

    async def full_response(self, run: ResponsesRun) -> dict:
        response = await self.chat.full_response(run.chat)
        (choice,) = response.choices
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        output = []
        if choice.message.reasoning:
            item_id = "rs_" + run.response_id.removeprefix("resp_")
            output.append(reasoning_item(item_id, choice.message.reasoning, status))
        if choice.message.content:
            item_id = "msg_" + run.response_id.removeprefix("resp_")
            output.append(message_item(item_id, choice.message.content, status))
        for call in choice.message.tool_calls:
            fn = call.function
            output.append(function_call_item(call.id, fn.name, fn.arguments, "completed"))
        usage = response.usage
        counts = (usage.prompt_tokens, usage.completion_tokens)
        return self.finish(run, choice.finish_reason, output, counts)

    async def stream_response(self, run: ResponsesRun) -> AsyncIterator[str]:
        events = ResponseEvents()
        output: list[dict] = []
        text: list[str] = []  # the open message item's text
        item_id = "msg_" + run.response_id.removeprefix("resp_")
        thought: list[str] = []  # the open reasoning item's text
        reasoning_id = "rs_" + run.response_id.removeprefix("resp_")
        num_tokens = 0
        open_calls: dict[int, tuple[dict, int, list[str]]] = {}  # item, output index, pieces

        def close_reasoning() -> list[str]:
            if not thought:
                return []
            index, whole = len(output), "".join(thought)
            item = reasoning_item(reasoning_id, whole, "completed")
            output.append(item)
            thought.clear()
            at = {"item_id": reasoning_id, "output_index": index, "content_index": 0}
            return [
                events.emit("response.reasoning_text.done", **at, text=whole),
                events.emit("response.output_item.done", output_index=index, item=item),
            ]

        def close_text(status: str) -> list[str]:
            if not text:
                return []
            index, whole = len(output), "".join(text)
            item = message_item(item_id, whole, status)
            output.append(item)
            text.clear()
            at = {"item_id": item_id, "output_index": index, "content_index": 0}
            return [
                events.emit("response.output_text.done", **at, text=whole, logprobs=[]),
                events.emit("response.content_part.done", **at, part=_text_part(whole)),
                events.emit("response.output_item.done", output_index=index, item=item),
            ]

        try:
            start = self.body(run, "in_progress", [])
            yield events.emit("response.created", response=start)
            yield events.emit("response.in_progress", response=start)
            async for thinking, piece, calls, delta in self.chat.parsed_deltas(run.chat):
                num_tokens += len(delta.token_ids)
                if thinking:
                    index = len(output)
                    at = {"item_id": reasoning_id, "output_index": index, "content_index": 0}
                    if not thought:
                        item = reasoning_item(reasoning_id, "", "in_progress")
                        yield events.emit("response.output_item.added", output_index=index, item=item)  # fmt: skip
                    thought.append(thinking)
                    yield events.emit("response.reasoning_text.delta", **at, delta=thinking)
                if piece or calls or delta.finish_reason is not None:
                    for e in close_reasoning():
                        yield e
                if piece:
                    index = len(output)
                    at = {"item_id": item_id, "output_index": index, "content_index": 0}
                    if not text:
                        item = message_item(item_id, None, "in_progress")
                        yield events.emit("response.output_item.added", output_index=index, item=item)  # fmt: skip
                        yield events.emit("response.content_part.added", **at, part=_text_part(""))  # fmt: skip
                    text.append(piece)
                    yield events.emit("response.output_text.delta", **at, delta=piece, logprobs=[])
                for call in calls:  # pieces: the name first, then the arguments
                    if call.id is not None:
                        for e in close_text("completed"):
                            yield e
                        item = function_call_item(call.id, call.name, "", "in_progress")
                        open_calls[call.index] = (item, len(output), [])
                        yield events.emit("response.output_item.added", output_index=len(output), item=item)  # fmt: skip
                    item, index, arguments = open_calls[call.index]
                    at = {"item_id": item["id"], "output_index": index}
                    if call.arguments:
                        arguments.append(call.arguments)
                        yield events.emit("response.function_call_arguments.delta", **at, delta=call.arguments)  # fmt: skip
                    if call.done:
                        whole = "".join(arguments)
                        yield events.emit("response.function_call_arguments.done", **at, name=item["name"], arguments=whole)  # fmt: skip
                        item = {**item, "arguments": whole, "status": "completed"}
                        output.append(item)
                        yield events.emit(
                            "response.output_item.done", output_index=index, item=item
                        )
                        del open_calls[call.index]
                if delta.finish_reason is None:
                    continue
                cut = delta.finish_reason == "length"
                for e in close_text("incomplete" if cut else "completed"):
                    yield e
                counts = (run.chat.stream.num_prompt_tokens, num_tokens)
                body = self.finish(run, delta.finish_reason, output, counts)
                kind = "response.incomplete" if cut else "response.completed"
                yield events.emit(kind, response=body)
        except (RequestFailedError, EngineDeadError, APIError) as e:
            logger.error("responses stream %s failed: %s", run.response_id, e)
            error = e if isinstance(e, APIError) else failure_to_api_error(e)
            yield events.emit("error", code=error.code, message=error.message, param=error.param)
        finally:
            self.chat.abort_unfinished(run.streams)

    def get(self, response_id: str) -> dict:
        return self.store.get(response_id).body

    def delete(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


class ResponseEvents:
    """A stream's events, numbered in order as the Responses API numbers them."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def emit(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
