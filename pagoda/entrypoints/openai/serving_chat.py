"""POST /v1/chat/completions: messages through the model's chat template.

The engine's front door renders the messages exactly as `LLM.chat` does
(`apply_chat_template(tokenize=False, add_generation_prompt=True)`, then
`encode(add_special_tokens=False)`), on its own thread, so greedy replies
match the offline API. Streaming: first a chunk per choice whose delta
carries the role, then content deltas, the finish_reason on each choice's
last chunk, a usage chunk when asked, and `[DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagoda.engine.async_engine import RequestStream
from pagoda.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    ResponseMessage,
    UsageInfo,
    now,
    random_id,
)
from pagoda.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    StreamUsage,
    bad_request,
    choice_deltas,
    failure_to_api_error,
    sse_error,
)
from pagoda.errors import EngineDeadError, RequestFailedError
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ChatRun:
    """An accepted request: what the response is built from."""

    req: ChatCompletionRequest
    response_id: str
    model: str
    params: SamplingParams
    stream: RequestStream


class OpenAIServingChat(OpenAIServing):
    @staticmethod
    def conversation(req) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in req.messages]

    async def start(self, req: ChatCompletionRequest) -> ChatRun:
        """Check and add the request; everything that fails here is the client's (4xx)."""
        model = self.check_model(req.model)
        self.check_supported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        max_tokens = req.max_tokens
        renames = {"logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        prompt = {
            "messages": self.conversation(req),
            "add_generation_prompt": req.add_generation_prompt,
        }
        if req.chat_template_kwargs is not None:
            prompt["chat_template_kwargs"] = req.chat_template_kwargs
        response_id = random_id("chatcmpl")
        (stream,) = await super().start(response_id, [prompt], params, req.priority, renames)
        return ChatRun(req, response_id, model, params, stream)

    def _logprobs(self, token_ids, positions, params: SamplingParams) -> ChatLogprobs | None:
        if params.logprobs is None:
            return None
        return ChatLogprobs(content=self.chat_logprobs(token_ids, positions, params.logprobs))

    async def full_response(self, run: ChatRun) -> ChatCompletionResponse:
        created, params = now(), run.params
        choices = {}
        try:
            async for choice, _, _ in choice_deltas([run.stream], params.n, keep_parts=True):
                choices[choice.index] = choice
        except (RequestFailedError, EngineDeadError) as e:
            raise failure_to_api_error(e) from e
        finally:
            self.abort_unfinished([run.stream])
        result = [
            ChatChoice(
                index=c.index,
                message=ResponseMessage(content=c.text),
                logprobs=self._logprobs(c.token_ids, c.logprobs, params),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in sorted(choices.values(), key=lambda c: c.index)
        ]
        num_completion = sum(c.num_tokens for c in choices.values())
        usage = UsageInfo.of(run.stream.num_prompt_tokens, num_completion)
        return ChatCompletionResponse(
            id=run.response_id, created=created, model=run.model, choices=result, usage=usage
        )

    async def stream_response(self, run: ChatRun) -> AsyncIterator[str]:
        created, params = now(), run.params
        usage = StreamUsage.of(run.req, run.stream.num_prompt_tokens)

        def chunk(choices: list[ChatChunkChoice], last: bool = False) -> str:
            body = ChatCompletionChunk(
                id=run.response_id, created=created, model=run.model, choices=choices
            ).model_dump()
            for choice in body["choices"]:  # a delta holds only what changed
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return usage.event(body, last)

        try:
            for i in range(params.n):
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatChunkChoice(index=i, delta=role)])
            async for choice, delta, _ in choice_deltas([run.stream], params.n, False):
                usage.num_completion_tokens += len(delta.token_ids)
                logprobs = self._logprobs(delta.token_ids, delta.logprobs, params)
                if not (delta.text or delta.finish_reason or (logprobs and logprobs.content)):
                    continue
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=choice.index,
                            delta=DeltaMessage(content=delta.text),
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
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
