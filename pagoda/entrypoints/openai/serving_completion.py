"""POST /v1/completions: one engine request per prompt, n completions each.

Choice `index` is `prompt_index * n + completion_index`, as OpenAI and vLLM
number them. Streaming sends one chunk per choice per engine step that
produced text, then a usage chunk when asked, then `[DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagoda.engine.async_engine import EngineNotAcceptingError, RequestStream
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
    SSE_DONE,
    OpenAIServing,
    Prompt,
    bad_request,
    merge_streams,
    sse,
    sse_error,
)
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _ChoiceState:
    """What one choice has streamed so far."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # for logprobs.text_offset
    started: bool = False  # the first chunk (echo, prompt_logprobs) went out
    finished: bool = False


class OpenAIServingCompletion(OpenAIServing):
    def parse_prompts(self, prompt) -> list[Prompt]:
        """str | list[str] | list[int] | list[list[int]] -> [(text or None, token ids)]."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty.", "prompt")
        prompts: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                token_ids = self.tokenizer.encode(item)  # as LLM.generate tokenizes
                prompts.append((item, token_ids))
            else:
                self.check_token_ids(item, "prompt")
                prompts.append((None, list(item)))
            if not prompts[-1][1]:
                raise bad_request("prompt must not be empty.", "prompt")
        return prompts

    async def start(self, req: CompletionRequest):
        """Validate and add the request; returns (response id, model, prompts, params,
        streams). Everything here that fails is the client's error (4xx)."""
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (use n).", "best_of")
        prompts = self.parse_prompts(req.prompt)
        for _, token_ids in prompts:
            self.check_length(len(token_ids), req.max_tokens, "prompt")
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = req.logprobs  # echoed prompt tokens get logprobs too
        params = self.sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs)
        response_id = random_id("cmpl")
        streams = await self.add_requests(response_id, prompts, params, req.priority)
        return response_id, model, prompts, params, streams

    def _prompt_echo(self, prompt: Prompt, output: RequestOutput, params: SamplingParams):
        """(text, logprobs) of the echoed prompt."""
        text, token_ids = prompt
        if text is None:
            text = self.tokenizer.decode(token_ids)
        logprobs = None
        if params.logprobs is not None:
            logprobs = self.completion_logprobs(
                token_ids, output.prompt_logprobs, params.logprobs, 0
            )
        return text, logprobs

    def _choice_delta(
        self,
        state: _ChoiceState,
        comp: CompletionOutput,
        output: RequestOutput,
        prompt: Prompt,
        params: SamplingParams,
        echo: bool,
        stream: bool,
    ) -> tuple[str, CompletionLogprobs | None]:
        """The text (and logprobs) of `comp` not yet sent; advances `state`."""
        finished = comp.finish_reason is not None
        visible = (
            comp.text  # the engine holds back a possible stop string
            if stream
            else comp.text
        )
        text = visible[state.num_chars :]
        logprobs = None
        if echo and not state.started:
            prompt_text, logprobs = self._prompt_echo(prompt, output, params)
            text = prompt_text + text
            state.text_offset = len(prompt_text)
        state.started = True
        new_ids = comp.token_ids[state.num_tokens :]
        if params.logprobs is not None:
            positions = comp.logprobs[state.num_tokens :] if comp.logprobs is not None else None
            new = self.completion_logprobs(new_ids, positions, params.logprobs, state.text_offset)
            if logprobs is None:
                logprobs = new
            else:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, name).extend(getattr(new, name))
            state.text_offset = (
                new.text_offset[-1] + len(new.tokens[-1]) if new_ids else state.text_offset
            )
        state.num_chars = len(visible)
        state.num_tokens = len(comp.token_ids)
        state.finished = finished
        return text, logprobs

    async def full_response(
        self, req: CompletionRequest, response_id, model, prompts, params, streams
    ) -> CompletionResponse:
        created = now()
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, output in merge_streams(streams):
                if output.finished:
                    finals[i] = output
        finally:
            self.abort_unfinished(streams)
        choices = []
        usage = UsageInfo()
        for i, prompt in enumerate(prompts):
            output = finals[i]
            usage.prompt_tokens += len(output.prompt_token_ids)
            for comp in sorted(output.outputs, key=lambda c: c.index):
                text, logprobs = self._choice_delta(
                    _ChoiceState(), comp, output, prompt, params, req.echo, stream=False
                )
                usage.completion_tokens += len(comp.token_ids)
                choices.append(
                    CompletionChoice(
                        index=i * params.n + comp.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=comp.finish_reason,
                        stop_reason=comp.stop_reason,
                        prompt_logprobs=self.prompt_logprobs(output)
                        if req.prompt_logprobs is not None
                        else None,
                    )
                )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(
            id=response_id, created=created, model=model, choices=choices, usage=usage
        )

    async def stream_response(
        self,
        req: CompletionRequest,
        response_id: str,
        model: str,
        prompts: list[Prompt],
        params: SamplingParams,
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        states: dict[int, _ChoiceState] = {}
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            body = CompletionResponse(
                id=response_id, created=created, model=model, choices=choices, usage=usage
            ).model_dump()
            if not include_usage:
                del body["usage"]
            return sse(body)

        try:
            async for i, output in merge_streams(streams):
                for comp in output.outputs:
                    index = i * params.n + comp.index
                    state = states.setdefault(index, _ChoiceState())
                    if state.finished:
                        continue
                    had_tokens, first = state.num_tokens, not state.started
                    text, logprobs = self._choice_delta(
                        state, comp, output, prompts[i], params, req.echo, stream=True
                    )
                    new_tokens = state.num_tokens > had_tokens and params.logprobs is not None
                    if not (text or state.finished or new_tokens):
                        state.started = not first  # nothing sent yet: still the first chunk
                        continue
                    choice = CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=comp.finish_reason,
                        stop_reason=comp.stop_reason,
                        prompt_logprobs=self.prompt_logprobs(output)
                        if first and req.prompt_logprobs is not None
                        else None,
                    )
                    yield chunk([choice])
            if include_usage:
                completion_tokens = sum(s.num_tokens for s in states.values())
                usage = UsageInfo.of(num_prompt_tokens, completion_tokens)
                yield chunk([], usage)
            yield SSE_DONE
        except EngineNotAcceptingError as e:
            logger.error("completion stream %s failed: %s", response_id, e)
            yield sse_error(str(e))
            yield SSE_DONE
        finally:
            self.abort_unfinished(streams)
