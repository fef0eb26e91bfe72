"""POST /v1/completions: one engine request per prompt, n completions each.

Streaming sends one chunk per choice per engine step that produced text (the
first carrying the echoed prompt when asked), then a usage chunk when asked,
then `[DONE]`. A whole response gathers the same deltas.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from pagoda.engine.messages import RequestStream
from pagoda.engine.processor import PromptType
from pagoda.entrypoints.openai.errors import SSE_DONE, failure_to_api_error, sse_error
from pagoda.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now,
    random_id,
)
from pagoda.entrypoints.openai.serving_engine import (
    Choice,
    OpenAIServing,
    StreamUsage,
    choice_deltas,
)
from pagoda.errors import EngineDeadError, RequestFailedError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.request import SLO
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RENAMES = {"prompt_token_ids": "prompt"}  # the front door's names -> this endpoint's


@dataclass
class CompletionRun:
    """An accepted request: what the response is built from."""

    req: CompletionRequest
    response_id: str
    model: str
    params: SamplingParams
    streams: list[RequestStream]


def to_prompts(prompt: str | list) -> list[PromptType]:
    """str | list[str] | list[int] | list[list[int]] -> the engine's prompts (the types
    are the body model's; the Processor checks the values)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class OpenAIServingCompletion(OpenAIServing):
    async def start(
        self, req: CompletionRequest, trace_headers: Mapping[str, str] | None = None
    ) -> CompletionRun:
        """Check and add the request; everything that fails here is the client's (4xx)."""
        model, lora_request = self.check_model(req.model)
        self.check_supported(req)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = req.logprobs  # echoed prompt tokens get logprobs too
        constraint, source = self.structured_outputs(req)
        renames = {**RENAMES, "structured_outputs": source} if source else RENAMES
        params = self.sampling_params(
            req, renames, req.max_tokens, req.logprobs, prompt_logprobs, constraint
        )
        response_id = random_id("cmpl")
        streams = await super().start(
            response_id,
            to_prompts(req.prompt),
            params,
            req.priority,
            renames,
            lora_request,
            trace_headers,
            SLO(req.slo_ttft_ms, req.slo_tpot_ms),
        )
        return CompletionRun(req, response_id, model, params, streams)

    async def _echo(self, output: RequestOutput, params: SamplingParams):
        """(text, logprobs) of a prompt to echo before its completions."""
        text = output.prompt
        if text is None:  # token ids: decoded on the processor thread
            text = await self.engine.run_in_processor(
                self.tokenizer.decode, output.prompt_token_ids
            )
        logprobs = None
        if params.logprobs is not None:
            logprobs = self.completion_logprobs(
                output.prompt_token_ids, output.prompt_logprobs, params.logprobs, 0
            )
        return text, logprobs

    def _logprobs(self, delta: CompletionOutput, params: SamplingParams, text_offset: int):
        if params.logprobs is None:
            return None
        return self.completion_logprobs(
            delta.token_ids, delta.logprobs, params.logprobs, text_offset
        )

    async def full_response(self, run: CompletionRun) -> CompletionResponse:
        created, params, req = now(), run.params, run.req
        choices: dict[int, Choice] = {}
        outputs: dict[int, RequestOutput] = {}
        try:
            async for choice, _, output in choice_deltas(run.streams, params.n, keep_parts=True):
                choices[choice.index] = choice
                outputs.setdefault(choice.prompt_index, output)
                if output.prompt_logprobs is not None:
                    outputs[choice.prompt_index] = output  # the one that carries them
        except (RequestFailedError, EngineDeadError) as e:
            raise failure_to_api_error(e) from e
        finally:
            self.abort_unfinished(run.streams)
        result = []
        for index in sorted(choices):
            choice = choices[index]
            output = outputs[choice.prompt_index]
            text, logprobs = choice.text, None
            if params.logprobs is not None:
                logprobs = self.completion_logprobs(
                    choice.token_ids, choice.logprobs, params.logprobs, 0
                )
            if req.echo:
                prompt_text, prompt_logprobs = await self._echo(output, params)
                text = prompt_text + text
                if logprobs is not None:
                    logprobs = _shifted(prompt_logprobs, logprobs, prompt_text)
            result.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(output)
                    if req.prompt_logprobs is not None
                    else None,
                )
            )
        num_prompt = sum(s.num_prompt_tokens for s in run.streams)
        usage = UsageInfo.of(num_prompt, sum(c.num_tokens for c in choices.values()))
        return CompletionResponse(
            id=run.response_id, created=created, model=run.model, choices=result, usage=usage
        )

    async def stream_response(self, run: CompletionRun) -> AsyncIterator[str]:
        created, params, req = now(), run.params, run.req
        usage = StreamUsage.of(req, sum(s.num_prompt_tokens for s in run.streams))
        text_offsets: dict[int, int] = {}

        def chunk(choices: list[CompletionChoice], last: bool = False) -> str:
            body = CompletionResponse(
                id=run.response_id, created=created, model=run.model, choices=choices
            ).model_dump()
            return usage.event(body, last)

        # Per prompt, the output that carried its prompt logprobs (they come once, with the
        # first token of any of its completions): a sibling that starts later echoes from it.
        prompt_outputs: dict[int, RequestOutput] = {}
        try:
            async for choice, delta, output in choice_deltas(run.streams, params.n, False):
                if output.prompt_logprobs is not None or choice.prompt_index not in prompt_outputs:
                    prompt_outputs[choice.prompt_index] = output
                output = prompt_outputs[choice.prompt_index]
                usage.num_completion_tokens += len(delta.token_ids)
                text, offset = delta.text, text_offsets.get(choice.index, 0)
                logprobs = self._logprobs(delta, params, offset)
                first = not choice.started
                if first and req.echo:
                    prompt_text, prompt_logprobs = await self._echo(output, params)
                    text = prompt_text + text
                    if logprobs is not None:
                        logprobs = _shifted(prompt_logprobs, logprobs, prompt_text)
                if logprobs is not None and logprobs.tokens:
                    text_offsets[choice.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                if not (text or delta.finish_reason or (logprobs and logprobs.tokens)):
                    continue
                choice.started = True
                yield chunk(
                    [
                        CompletionChoice(
                            index=choice.index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                            stop_reason=delta.stop_reason,
                            prompt_logprobs=self.prompt_logprobs(output)
                            if first and req.prompt_logprobs is not None
                            else None,
                        )
                    ]
                )
            if usage.in_last_chunk:
                yield chunk([], last=True)
            yield SSE_DONE
        except (RequestFailedError, EngineDeadError) as e:
            logger.error("completion stream %s failed: %s", run.response_id, e)
            yield sse_error(failure_to_api_error(e))
            yield SSE_DONE
        finally:
            self.abort_unfinished(run.streams)


def _shifted(
    prompt: CompletionLogprobs | None, completion: CompletionLogprobs, prompt_text: str
) -> CompletionLogprobs:
    """The echoed prompt's logprobs, then the completion's with offsets moved past them:
    past the prompt tokens' own texts (which may differ from the prompt's, e.g. a BOS)."""
    shift = len(prompt_text)
    if prompt is not None and prompt.tokens:
        shift = prompt.text_offset[-1] + len(prompt.tokens[-1])
    out = prompt or CompletionLogprobs()
    out.tokens += completion.tokens
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    out.text_offset += [o + shift for o in completion.text_offset]
    return out
