"""What /v1/completions and /v1/chat/completions share: errors, sampling
parameters, length checks, adding requests all-or-nothing, merging streams,
logprobs in OpenAI's two shapes, and the SSE framing."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagoda.engine.async_engine import AsyncEngine, RequestStream
from pagoda.entrypoints.openai.protocol import (
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
)
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

# A prompt after tokenization: (its text, if it came as text; its token ids).
Prompt = tuple[str | None, list[int]]

_FIELD = re.compile(r"^([a-z_]+)\b")


class APIError(Exception):
    """An error the client caused (or may retry), rendered as OpenAI's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def param_of(error: ValueError, renames: dict[str, str] | None = None) -> str | None:
    """pagoda's ValueErrors start with the field name; that is OpenAI's `param`."""
    match = _FIELD.match(str(error))
    if match is None:
        return None
    name = match.group(1)
    return (renames or {}).get(name, name)


def safe_logprob(value: float) -> float:
    """JSON has no -inf or NaN; OpenAI clients expect a number (vLLM sends -9999)."""
    return value if math.isfinite(value) else -9999.0


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_error(message: str) -> str:
    """An error event inside a stream that has already answered 200."""
    return sse(
        {"error": {"message": message, "type": "InternalServerError", "param": None, "code": None}}
    )


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """Shared by the completion and chat handlers; one per server."""

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str]) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = int(engine.model_config.hf_config["vocab_size"])
        self.generation_defaults = dict(engine.model_config.generation_defaults)
        self._token_text: dict[int, str] = {}

    # ---- request checks -----------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if model is None or model in self.served_model_names:
            return self.served_model_names[0] if model is None else model
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves: "
            f"{', '.join(self.served_model_names)}.",
            "NotFoundError",
            "model",
            "model_not_found",
        )

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str):
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{prompt_param} is {num_prompt_tokens} tokens long, which leaves no room for "
                "a completion. Please shorten it.",
                prompt_param,
                "context_length_exceeded",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"{prompt_param}, {max_tokens} in the completion). Please reduce the length of "
                f"the {prompt_param} or the completion.",
                "max_tokens",
                "context_length_exceeded",
            )

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        renames: dict[str, str] | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; a bad value is a 400 naming its field.

        Unset temperature/top_p/top_k/min_p fall back to the model's
        generation_config, then to OpenAI's defaults (as vLLM does).
        """
        defaults = self.generation_defaults

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        logit_bias = None
        if req.logit_bias:
            logit_bias = {}
            for key, bias in req.logit_bias.items():
                if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.vocab_size:
                    raise bad_request(
                        f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}.",
                        "logit_bias",
                    )
                if not -100.0 <= bias <= 100.0:
                    raise bad_request(
                        f"logit_bias values must be in [-100, 100], got {bias}.", "logit_bias"
                    )
                logit_bias[int(key)] = bias
        top_k = pick("top_k", -1)
        try:
            return SamplingParams(
                n=req.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=-1 if top_k == 0 else top_k,  # vLLM: 0 also disables
                min_p=pick("min_p", 0.0),
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                logit_bias=logit_bias,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                skip_special_tokens=req.skip_special_tokens,
            )
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), param_of(ValueError(str(e)), renames)) from e

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"{param} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}.",
                param,
            )

    # ---- running requests ---------------------------------------------------------------

    async def add_requests(
        self, base_id: str, prompts: list[Prompt], params: SamplingParams, priority: int
    ) -> list[RequestStream]:
        """Add one engine request per prompt, all or nothing (queued in one go)."""
        self.engine.check_capacity(len(prompts))
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        coros = []
        for request_id, (text, token_ids) in zip(ids, prompts, strict=True):
            prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
            if text is not None:
                prompt["prompt"] = text
            coros.append(self.engine.add_request(request_id, prompt, params, priority))
        try:
            results = await asyncio.gather(*coros, return_exceptions=True)
        except asyncio.CancelledError:
            self.engine.abort(ids)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.engine.abort(ids)
            error = errors[0]
            if isinstance(error, ValueError):
                raise bad_request(str(error), param_of(error)) from error
            raise error
        return list(results)

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        ids = [s.request_id for s in streams if not s.finished]
        if ids:
            self.engine.abort(ids)

    # ---- logprobs -------------------------------------------------------------------------

    def token_text(self, token_id: int, logprob: Any = None) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def completion_logprobs(
        self,
        token_ids: list[int],
        positions: Sequence[dict | None] | None,
        num_top: int,
        text_offset: int,
    ) -> CompletionLogprobs:
        """Legacy completions logprobs for these tokens; `positions[i]` maps token id ->
        Logprob for token i (None where unknown, e.g. a prompt's first token)."""
        out = CompletionLogprobs()
        for i, token_id in enumerate(token_ids):
            position = positions[i] if positions is not None and i < len(positions) else None
            chosen = position.get(token_id) if position else None
            token = self.token_text(token_id, chosen)
            out.tokens.append(token)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            out.token_logprobs.append(safe_logprob(chosen.logprob) if chosen else None)
            if not position:
                out.top_logprobs.append(None)
                continue
            top = _top(position, num_top, always=token_id)
            out.top_logprobs.append(
                {self.token_text(t, lp): safe_logprob(lp.logprob) for t, lp in top}
            )
        return out

    def prompt_logprobs(self, output: RequestOutput) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's `prompt_logprobs` of a choice: per prompt token, id -> Logprob."""
        return [
            None
            if position is None
            else {
                str(t): PromptLogprob(
                    logprob=safe_logprob(lp.logprob),
                    rank=lp.rank,
                    decoded_token=self.token_text(t, lp),
                )
                for t, lp in position.items()
            }
            for position in output.prompt_logprobs or []
        ]

    def chat_logprobs(
        self, token_ids: list[int], positions: Sequence[dict | None] | None, num_top: int
    ) -> list[TokenLogprob]:
        content = []
        for i, token_id in enumerate(token_ids):
            position = positions[i] if positions is not None and i < len(positions) else None
            chosen = position.get(token_id) if position else None
            token = self.token_text(token_id, chosen)
            tops = [
                TopLogprob(
                    token=(text := self.token_text(t, lp)),
                    logprob=safe_logprob(lp.logprob),
                    bytes=list(text.encode()),
                )
                for t, lp in (_top(position, num_top) if position else [])
            ]
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=safe_logprob(chosen.logprob) if chosen else -9999.0,
                    bytes=list(token.encode()),
                    top_logprobs=tops,
                )
            )
        return content


def _top(position: dict, num_top: int, always: int | None = None) -> list[tuple[int, Any]]:
    """The position's top-`num_top` entries by logprob (plus `always`), best first."""
    ranked = sorted(position.items(), key=lambda kv: kv[1].logprob, reverse=True)
    return [(t, lp) for i, (t, lp) in enumerate(ranked) if i < num_top or t == always]


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come. The caller
    aborts unfinished requests when it stops early."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
