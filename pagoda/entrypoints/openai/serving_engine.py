"""What /v1/completions and /v1/chat/completions share: turning a body into
SamplingParams, adding requests all-or-nothing through the engine's front door,
the one path that turns the engine's delta outputs into per-choice deltas (for
streamed and whole responses alike), logprobs in OpenAI's two shapes. Errors and
SSE framing: errors.py.

Nothing here checks a value: the `Processor` does (on its own thread), and its
`InvalidRequestError` becomes a 400 whose `param` is the body's field name.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagoda.checks import check_all_text
from pagoda.core.structured_output import KINDS as STRUCTURED_KINDS
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.messages import ProcessedRequest, RequestStream
from pagoda.engine.processor import PromptType
from pagoda.entrypoints.openai.errors import (
    bad_request,
    from_invalid,
    sse,
)
from pagoda.entrypoints.openai.protocol import (
    CompletionLogprobs,
    OpenAIModel,
    PromptLogprob,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.request import SLO
from pagoda.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.serving_models import ServingModels


def safe_logprob(value: float) -> float:
    """JSON has no -inf or NaN; OpenAI clients expect a number (vLLM sends -9999)."""
    return value if math.isfinite(value) else -9999.0


@dataclass
class StreamUsage:
    """A stream's token counts, and where its `stream_options` want them: in a last
    chunk (`include_usage`), in every chunk (`continuous_usage_stats`), or nowhere."""

    num_prompt_tokens: int
    in_last_chunk: bool
    in_every_chunk: bool
    num_completion_tokens: int = 0

    @classmethod
    def of(cls, req: SamplingFields, num_prompt_tokens: int) -> StreamUsage:
        options = req.stream_options
        return cls(
            num_prompt_tokens,
            bool(options and options.include_usage),
            bool(options and options.continuous_usage_stats),
        )

    def event(self, body: dict[str, Any], last: bool = False) -> str:
        """The SSE event for a chunk's body, with its usage as asked."""
        if last or self.in_every_chunk:
            usage = UsageInfo.of(self.num_prompt_tokens, self.num_completion_tokens)
            body["usage"] = usage.model_dump()
        elif not self.in_last_chunk:
            del body["usage"]
        return sse(body)


@dataclass
class Choice:
    """One choice of a response (completion `index` of prompt `prompt_index`), as its
    deltas arrive. Whole responses keep the parts; streams only count."""

    index: int
    prompt_index: int
    keep_parts: bool
    num_tokens: int = 0
    started: bool = False  # a first chunk went out (streams: echo, role)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


async def choice_deltas(
    streams: list[RequestStream], n: int, keep_parts: bool
) -> AsyncIterator[tuple[Choice, CompletionOutput, RequestOutput]]:
    """The one path from engine outputs to responses: (choice, its delta, the output it
    came in) as deltas arrive from every prompt's stream. Choice indices are
    `prompt_index * n + completion_index`, as OpenAI and vLLM number them."""
    choices: dict[int, Choice] = {}
    async for i, output in merge_streams(streams):
        for delta in output.outputs:
            index = i * n + delta.index
            choice = choices.get(index)
            if choice is None:
                choice = choices[index] = Choice(index, i, keep_parts)
            choice.num_tokens += len(delta.token_ids)
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            if keep_parts:
                choice.text_parts.append(delta.text)
                choice.token_ids += delta.token_ids
                choice.logprobs += delta.logprobs or []
            yield choice, delta, output


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


class OpenAIServing:
    """Shared by the completion and chat handlers; one per server."""

    def __init__(self, engine: AsyncEngine, models: ServingModels) -> None:
        self.engine = engine
        self.models = models
        self.processor = engine.engine.processor
        self.tokenizer = self.processor.tokenizer  # the processor's own copy
        self.generation_defaults = dict(engine.model_config.generation_defaults)
        self._token_text: dict[int, str] = {}

    # ---- request checks that are the protocol's, not the engine's --------------------

    def check_model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to answer with, the LoRA adapter it names or None); 404 for a model
        this server does not serve."""
        return self.models.resolve(model)

    def check_supported(self, req: OpenAIModel) -> None:
        """A 400 for a field set to a value pagoda does not honour (see SUPPORTED_ONLY)."""
        for name, (ok, why) in type(req).SUPPORTED_ONLY.items():
            value = getattr(req, name)
            if not ok(value):
                raise bad_request(
                    f"{name}={json.dumps(value)[:80]} is not supported: {why}.",
                    name,
                    "unsupported_value",
                )
        for name in ("user", "metadata"):  # accepted without effect, but still text
            try:
                check_all_text(getattr(req, name, None), name)
            except InvalidRequestError as e:
                raise from_invalid(e) from e

    # ---- requests ------------------------------------------------------------------

    @staticmethod
    def structured_outputs(
        req: SamplingFields, response_format: dict | None = None
    ) -> tuple[StructuredOutputsParams | None, str | None]:
        """The body's output constraint and the field it came from: vLLM's
        `structured_outputs`, its older `guided_*` fields, or OpenAI's `response_format`
        (chat). The grammar itself is checked by the front door."""
        guided = {k: getattr(req, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
        guided = {k: v for k, v in guided.items() if v is not None}
        sources = [
            name
            for name, given in (
                ("structured_outputs", req.structured_outputs is not None),
                (f"guided_{next(iter(guided), '')}", bool(guided)),
                ("response_format", response_format is not None),
            )
            if given
        ]
        if len(sources) > 1:
            raise bad_request(f"set only one of {', '.join(sources)}.", sources[1])
        if req.structured_outputs is not None:
            unknown = set(req.structured_outputs) - set(STRUCTURED_KINDS)
            if unknown:
                raise bad_request(
                    f"structured_outputs has fields pagoda does not know: "
                    f"{', '.join(sorted(unknown))} (it takes {', '.join(STRUCTURED_KINDS)}).",
                    "structured_outputs",
                )
            return StructuredOutputsParams(**req.structured_outputs), "structured_outputs"
        if guided:
            return StructuredOutputsParams(**guided), sources[0]
        if response_format is None:
            return None, None
        kind = response_format.get("type")
        if kind == "text":
            return None, None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        spec = response_format.get("json_schema")
        if kind != "json_schema" or not isinstance(spec, dict):
            raise bad_request(
                "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}.",
                "response_format",
            )
        if not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object.",
                "response_format",
            )
        # strict or not, the grammar holds the output to the schema.
        return StructuredOutputsParams(json=spec["schema"]), "response_format"

    def sampling_params(
        self,
        req: SamplingFields,
        renames: dict[str, str],
        max_tokens: int | None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The body's SamplingParams, as sent (checked at construction, then by the
        Processor; a 400 names the body's field through `renames`). Unset
        temperature/top_p/top_k/min_p/repetition_penalty fall back to the model's
        generation_config, then to OpenAI's defaults (as vLLM does); with use_beam_search
        to neutral values (temperature 0): beams rank by the model's own logprobs."""
        defaults = {} if req.use_beam_search else self.generation_defaults

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                n=req.n,
                temperature=pick("temperature", 0.0 if req.use_beam_search else 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", -1),
                min_p=pick("min_p", 0.0),
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                logit_bias=req.logit_bias,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [],
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                skip_special_tokens=req.skip_special_tokens,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=structured_outputs,
                use_beam_search=req.use_beam_search,
                best_of=req.best_of,
                length_penalty=req.length_penalty,
                early_stopping=req.early_stopping,
            )
        except InvalidRequestError as e:
            raise from_invalid(e, renames) from e

    async def start(
        self,
        base_id: str,
        prompts: list[PromptType],
        params: SamplingParams,
        priority: int,
        renames: dict[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        slo: SLO | None = None,
    ) -> list[RequestStream]:
        """One engine request per prompt, all or nothing: every prompt goes through the
        front door on the processor thread (a bad one is a 400 naming its field), then
        all are queued in one operation (or all refused: DeadlineUnmeetableError, a 429).
        `trace_headers`: the HTTP request's W3C trace context, the parent of each
        request's span. `slo`: the body's latency targets (vLLM-style extra fields)."""
        self.engine.check_capacity(len(prompts))
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        arrival = time.monotonic()

        def process_all() -> list[ProcessedRequest]:
            self.processor.check_num_prompts(len(prompts))
            out = []
            for request_id, prompt in zip(ids, prompts, strict=True):
                children, text = self.processor.process(
                    request_id, prompt, params, priority, arrival, lora_request, trace_headers,
                    slo,
                )  # fmt: skip
                out.append(ProcessedRequest(request_id, children, text))
            return out

        try:
            processed = await self.engine.run_in_processor(process_all)
        except InvalidRequestError as e:  # an adapter's problem is the `model` it names
            raise from_invalid(e, {"lora_request": "model", **(renames or {})}) from e
        return await self.engine.add_processed(processed)

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
