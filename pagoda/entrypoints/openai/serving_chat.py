"""POST /v1/chat/completions: messages through the model's chat template.

The engine's front door renders the messages exactly as `LLM.chat` does
(`apply_chat_template(tokenize=False, add_generation_prompt=True)`, then
`encode(add_special_tokens=False)`), on its own thread, so greedy replies
match the offline API. Streaming: first a chunk per choice whose delta
carries the role, then content deltas, the finish_reason on each choice's
last chunk, a usage chunk when asked, and `[DONE]`.

Tools (`pagoda.engine.tools`): with `tools` and a `tool_choice` other than "none",
the tools go into the prompt and each choice's text is parsed for Hermes-style calls
(`<tool_call>{...}</tool_call>`); "required" and a named function also constrain the
output with a grammar of such calls, so their arguments always match the schema.
A streamed call goes out in one delta once it has parsed; `finish_reason` is
"tool_calls" when a choice called one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from pagoda.engine.call_stream import CallDelta, merge_calls
from pagoda.engine.messages import RequestStream
from pagoda.engine.reasoning import ReasoningParser
from pagoda.engine.tool_parsers import MistralParser, forced_call_grammar, make_tool_parser
from pagoda.engine.tools import (
    CLOSE,
    OPEN,
    ParsedCall,
    check_tools,
    tool_names,
)
from pagoda.entrypoints.openai.errors import (
    SSE_DONE,
    bad_request,
    failure_to_api_error,
    from_invalid,
    sse_error,
)
from pagoda.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ResponseMessage,
    ToolCall,
    UsageInfo,
    now,
    random_id,
)
from pagoda.entrypoints.openai.serving_engine import OpenAIServing, StreamUsage, choice_deltas
from pagoda.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from pagoda.multimodal import allowed_remote_images, fetch_image_bytes
from pagoda.outputs import CompletionOutput
from pagoda.request import SLO
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class ChatRun:
    """An accepted request: what the response is built from."""

    req: ChatCompletionRequest
    response_id: str
    model: str
    params: SamplingParams
    stream: RequestStream
    tool_names: list[str] | None = None  # parse tool calls out of the text
    reasoning: bool = False  # split a <think> block off the text (--reasoning-parser)
    tool_parser: str = "hermes"  # the calls' format (--tool-call-parser)

    @property
    def streams(self) -> list[RequestStream]:
        return [self.stream]

    def parser(self, prompt: str | None) -> OutputParser:
        return OutputParser(prompt, self.reasoning, self.tool_names, self.tool_parser)


class OutputParser:
    """One choice's text as it streams, split into reasoning (with a reasoning parser),
    content, and tool calls (with tools); `feed` returns the new pieces of each, `last`
    on the choice's final text. A whole response feeds all its text at once: the same
    split as its stream."""

    def __init__(
        self,
        prompt: str | None,
        reasoning: bool,
        tool_names: list[str] | None,
        tool_parser: str = "hermes",
    ) -> None:
        self.reasoning = ReasoningParser(prompt) if reasoning else None
        self.tools = None if tool_names is None else make_tool_parser(tool_parser, tool_names)

    def feed(self, text: str, last: bool = False) -> tuple[str, str, list[CallDelta]]:
        thought, calls = "", []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if last:
                more_thought, more_text = self.reasoning.finish()
                thought, text = thought + more_thought, text + more_text
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if last:
                rest, more_calls = self.tools.finish()
                text, calls = text + rest, calls + more_calls
        return thought, text, calls


def tool_setup(
    req: ChatCompletionRequest, tag_ids: dict, parser: str = "hermes"
) -> tuple[list | None, str | None]:
    """(the checked tools to render, the grammar forcing a call or None) for the
    body's tools and tool_choice; a 400 for a bad combination."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", "tool_choice")
        return None, None
    try:
        tools = check_tools(req.tools)
    except InvalidRequestError as e:
        raise from_invalid(e) from e
    names = tool_names(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None
    if choice == "auto":
        return tools, None
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or "
                f"{{'type': 'function', 'function': {{'name': one of {names}}}}}.",
                "tool_choice",
            )
    elif choice != "required":
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or a function.", "tool_choice"
        )
    parallel = name is None and req.parallel_tool_calls is not False
    try:
        return tools, forced_call_grammar(parser, tools, name, parallel, tag_ids)
    except InvalidRequestError as e:
        raise from_invalid(e) from e


class OpenAIServingChat(OpenAIServing):
    tool_call_parser = "hermes"  # the server's --tool-call-parser

    @staticmethod
    def conversation(req) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in req.messages]

    async def fetch_images(self, messages: list[dict]) -> None:
        """Fetch the image URLs on allowed hosts (--allowed-media-domains) in worker
        threads, in place: each part's url becomes the fetched bytes."""
        limits = self.processor.limits
        try:
            found = allowed_remote_images(messages, limits)
            data = await asyncio.gather(
                *(
                    asyncio.to_thread(fetch_image_bytes, url, limits, "messages", where)
                    for _, _, url, where in found
                )
            )
        except InvalidRequestError as e:
            raise from_invalid(e) from e
        for (holder, key, _, _), payload in zip(found, data, strict=True):
            holder[key] = payload

    async def start(
        self, req: ChatCompletionRequest, trace_headers: Mapping[str, str] | None = None
    ) -> ChatRun:
        """Check and add the request; everything that fails here is the client's (4xx)."""
        model, lora_request = self.check_model(req.model)
        self.check_supported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        max_tokens = req.max_tokens
        renames = {"logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        constraint, source = self.structured_outputs(req, req.response_format)
        tools, call_grammar_ = tool_setup(req, self.tag_ids, self.tool_call_parser)
        if call_grammar_ is not None:
            if constraint is not None:
                raise bad_request(
                    f"tool_choice {req.tool_choice!r} constrains the output already; "
                    f"{source} cannot be set with it.",
                    source,
                )
            constraint, source = StructuredOutputsParams(grammar=call_grammar_), "tool_choice"
        if source:
            renames["structured_outputs"] = source
        params = self.sampling_params(
            req, renames, max_tokens, logprobs, structured_outputs=constraint
        )
        if tools and self.tool_call_parser == "mistral":
            params.skip_special_tokens = False  # [TOOL_CALLS] is a special token
        prompt = {
            "messages": self.conversation(req),
            "add_generation_prompt": req.add_generation_prompt,
        }
        if tools:
            prompt["tools"] = tools
        if req.chat_template_kwargs is not None:
            prompt["chat_template_kwargs"] = req.chat_template_kwargs
        await self.fetch_images(prompt["messages"])
        response_id = random_id("chatcmpl")
        slo = SLO(req.slo_ttft_ms, req.slo_tpot_ms)
        (stream,) = await super().start(
            response_id, [prompt], params, req.priority, renames, lora_request, trace_headers, slo
        )
        names = tool_names(tools) if tools else None
        reasoning = self.engine.model_config.reasoning_parser is not None
        return ChatRun(
            req, response_id, model, params, stream, names, reasoning, self.tool_call_parser
        )

    @functools.cached_property
    def tag_ids(self) -> dict[str, int]:
        """The tool-call tags that this tokenizer has as single tokens."""
        out = {}
        for tag in (OPEN, CLOSE, MistralParser.MARKER):
            ids = self.tokenizer.encode(tag, add_special_tokens=False)
            if len(ids) == 1:
                out[tag] = ids[0]
        return out

    def _logprobs(self, token_ids, positions, params: SamplingParams) -> ChatLogprobs | None:
        if params.logprobs is None:
            return None
        return ChatLogprobs(content=self.chat_logprobs(token_ids, positions, params.logprobs))

    async def full_response(self, run: ChatRun) -> ChatCompletionResponse:
        created, params = now(), run.params
        choices, prompt = {}, None
        try:
            async for choice, _, output in choice_deltas([run.stream], params.n, keep_parts=True):
                choices[choice.index] = choice
                prompt = output.prompt
        except (RequestFailedError, EngineDeadError) as e:
            raise failure_to_api_error(e) from e
        finally:
            self.abort_unfinished([run.stream])
        result = []
        for c in sorted(choices.values(), key=lambda c: c.index):
            thought, content, deltas = run.parser(prompt).feed(c.text, last=True)
            calls = merge_calls(deltas)
            if run.tool_names is not None:
                content = content or None
            message = ResponseMessage(
                content=content,
                tool_calls=[ToolCall(id=t.id, function=_function(t)) for t in calls],
                **_reasoning(thought if run.reasoning else None),
            )
            finish_reason = _finish_reason(c.finish_reason, calls)
            result.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c.token_ids, c.logprobs, params),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        num_completion = sum(c.num_tokens for c in choices.values())
        usage = UsageInfo.of(run.stream.num_prompt_tokens, num_completion)
        return ChatCompletionResponse(
            id=run.response_id, created=created, model=run.model, choices=result, usage=usage
        )

    async def parsed_deltas(
        self, run: ChatRun
    ) -> AsyncIterator[tuple[str, str, list[CallDelta], CompletionOutput]]:
        """(reasoning, content, pieces of tool calls, the delta they came in) as one
        choice's output streams: what the Messages and Responses streams are built from."""
        parser = None
        async for _, delta, output in choice_deltas([run.stream], 1, False):
            parser = parser or run.parser(output.prompt)
            thought, text, calls = parser.feed(delta.text, delta.finish_reason is not None)
            yield thought, text, calls, delta

    async def stream_response(self, run: ChatRun) -> AsyncIterator[str]:
        created, params = now(), run.params
        usage = StreamUsage.of(run.req, run.stream.num_prompt_tokens)

        def chunk(choices: list[ChatChunkChoice], last: bool = False) -> str:
            body = ChatCompletionChunk(
                id=run.response_id, created=created, model=run.model, choices=choices
            ).model_dump()
            for choice in body["choices"]:  # a delta holds only what changed
                choice["delta"] = _set_fields(choice["delta"])
            return usage.event(body, last)

        parsers: dict[int, OutputParser] = {}
        num_calls = [0] * params.n
        try:
            for i in range(params.n):
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatChunkChoice(index=i, delta=role)])
            async for choice, delta, output in choice_deltas([run.stream], params.n, False):
                usage.num_completion_tokens += len(delta.token_ids)
                logprobs = self._logprobs(delta.token_ids, delta.logprobs, params)
                i, finish_reason = choice.index, delta.finish_reason
                parser = parsers.setdefault(i, run.parser(output.prompt))
                thought, text, calls = parser.feed(delta.text, finish_reason is not None)
                calls = [d for d in calls if d.id is not None or d.arguments]
                num_calls[i] += sum(d.id is not None for d in calls)
                finish_reason = _finish_reason(finish_reason, num_calls[i])
                if not (thought or text or calls or finish_reason or (logprobs and logprobs.content)):  # fmt: skip
                    continue
                message = DeltaMessage(
                    content=(text or None) if calls or thought else text,
                    tool_calls=[_delta_call(d) for d in calls] or None,
                    **_reasoning(thought or None),
                )
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=choice.index,
                            delta=message,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=delta.stop_reason,
                        )
                    ]
                )
            if usage.in_last_chunk:
                yield chunk([], last=True)
            yield SSE_DONE
        except (RequestFailedError, EngineDeadError) as e:
            logger.error("chat stream %s failed: %s", run.response_id, e)
            yield sse_error(failure_to_api_error(e))
            yield SSE_DONE
        finally:
            self.abort_unfinished([run.stream])


def _finish_reason(finish_reason: str | None, calls: list) -> str | None:
    """ "tool_calls" for a choice that stopped having called tools (OpenAI's reason)."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _reasoning(thought: str | None) -> dict[str, str | None]:
    """The reasoning under vLLM's current name and its older one (`reasoning_content`,
    which older clients read)."""
    return {"reasoning": thought, "reasoning_content": thought}


def _function(call: ParsedCall) -> FunctionCall:
    return FunctionCall(name=call.name, arguments=call.arguments)


def _delta_call(d: CallDelta) -> DeltaToolCall:
    """A call's piece as OpenAI streams it: id, type and name first, then arguments."""
    function = DeltaFunctionCall(name=d.name, arguments=d.arguments)
    return DeltaToolCall(index=d.index, id=d.id, type=d.id and "function", function=function)


def _set_fields(value):
    """`value` without the fields left unset (None), all the way down."""
    if isinstance(value, dict):
        return {k: _set_fields(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_set_fields(v) for v in value]
    return value
