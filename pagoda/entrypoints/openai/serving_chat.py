"""POST /v1/chat/completions: messages through the model's chat template.

The prompt is rendered exactly as `LLM.chat` renders it
(`apply_chat_template(tokenize=False, add_generation_prompt=True)`, then
`encode(add_special_tokens=False)`), so greedy replies match the offline API.
Streaming: first a chunk per choice whose delta carries the role, then content
deltas, the finish_reason on each choice's last chunk, a usage chunk when
asked, and `[DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from pagoda.engine.async_engine import EngineNotAcceptingError, RequestStream
from pagoda.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    ResponseMessage,
    UsageInfo,
    now,
    random_id,
)
from pagoda.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    Prompt,
    bad_request,
    sse,
    sse_error,
)
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIServingChat(OpenAIServing):
    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """Messages -> (prompt text, token ids) via the chat template; 400 on bad messages."""
        conversation = []
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise bad_request(
                    f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message.role!r}.",
                    "messages",
                )
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"messages[{i}].content: only text parts are supported, got "
                            f"{part.type!r}.",
                            "messages",
                        )
                    texts.append(part.text)
                content = "\n".join(texts)
            conversation.append({"role": message.role, "content": content or ""})
        try:
            rendered = self.engine.engine.processor.render_chat(
                conversation, add_generation_prompt, template_kwargs
            )
        except ValueError as e:
            raise bad_request(str(e), "messages") from e
        return rendered["prompt"], rendered["prompt_token_ids"]

    async def start(self, req: ChatCompletionRequest):
        """Validate and add the request; returns (response id, model, prompt, params, stream)."""
        model = self.check_model(req.model)
        if req.tools:
            raise bad_request("tools are not supported.", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("only response_format type 'text' is supported.", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        max_tokens = req.max_tokens
        renames = {"logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        prompt = self.render(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        self.check_length(len(prompt[1]), max_tokens, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs, renames=renames)
        response_id = random_id("chatcmpl")
        streams = await self.add_requests(response_id, [prompt], params, req.priority)
        return response_id, model, prompt, params, streams[0]

    def _logprobs(self, comp, start: int, params: SamplingParams) -> ChatLogprobs | None:
        if params.logprobs is None:
            return None
        positions = comp.logprobs[start:] if comp.logprobs is not None else None
        return ChatLogprobs(
            content=self.chat_logprobs(comp.token_ids[start:], positions, params.logprobs)
        )

    async def full_response(
        self, req: ChatCompletionRequest, response_id, model, prompt, params, stream
    ) -> ChatCompletionResponse:
        created = now()
        final: RequestOutput | None = None
        try:
            async for output in stream:
                final = output
        finally:
            self.abort_unfinished([stream])
        choices = [
            ChatChoice(
                index=comp.index,
                message=ResponseMessage(content=comp.text),
                logprobs=self._logprobs(comp, 0, params),
                finish_reason=comp.finish_reason,
                stop_reason=comp.stop_reason,
            )
            for comp in sorted(final.outputs, key=lambda c: c.index)
        ]
        num_prompt = len(final.prompt_token_ids)
        num_completion = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo.of(num_prompt, num_completion)
        return ChatCompletionResponse(
            id=response_id, created=created, model=model, choices=choices, usage=usage
        )

    async def stream_response(
        self,
        req: ChatCompletionRequest,
        response_id: str,
        model: str,
        prompt: Prompt,
        params: SamplingParams,
        stream: RequestStream,
    ) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent_chars = [0] * params.n
        sent_tokens = [0] * params.n
        finished = [False] * params.n

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=choices, usage=usage
            ).model_dump()
            for choice in body["choices"]:  # a delta holds only what changed
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            if not include_usage:
                del body["usage"]
            return sse(body)

        try:
            for i in range(params.n):
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatChunkChoice(index=i, delta=role)])
            async for output in stream:
                for comp in output.outputs:
                    j = comp.index
                    if finished[j]:
                        continue
                    done = comp.finish_reason is not None
                    visible = comp.text  # the engine holds back a possible stop string
                    text = visible[sent_chars[j] :]
                    logprobs = self._logprobs(comp, sent_tokens[j], params)
                    new_tokens = len(comp.token_ids) > sent_tokens[j]
                    sent_chars[j], sent_tokens[j], finished[j] = (
                        len(visible),
                        len(comp.token_ids),
                        done,
                    )
                    if not (text or done or (new_tokens and logprobs is not None)):
                        continue
                    choice = ChatChunkChoice(
                        index=j,
                        delta=DeltaMessage(content=text),
                        logprobs=logprobs,
                        finish_reason=comp.finish_reason,
                        stop_reason=comp.stop_reason,
                    )
                    yield chunk([choice])
            if include_usage:
                num_prompt = len(prompt[1])
                num_completion = sum(sent_tokens)
                usage = UsageInfo.of(num_prompt, num_completion)
                yield chunk([], usage)
            yield SSE_DONE
        except EngineNotAcceptingError as e:
            logger.error("chat stream %s failed: %s", response_id, e)
            yield sse_error(str(e))
            yield SSE_DONE
        finally:
            self.abort_unfinished([stream])
