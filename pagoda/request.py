"""A request as the scheduler sees it: token ids and progress, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import RequestOutputKind, SamplingParams

# What a pooling request carries as its sampling parameters: it samples nothing, but the
# scheduler's parts read every request's (no grammar, no drafts, no logprobs).
POOLING_SAMPLING = SamplingParams(
    max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
)

if TYPE_CHECKING:
    from pagoda.core.structured_output import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # failed alone while running (its own inputs or sampling)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class SLO:
    """A request's latency targets in milliseconds (None: no target): time to its first
    token, and mean time per output token after it."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def or_defaults(self, defaults: SLO | None) -> SLO | None:
        """Each target unset here taken from `defaults` (the server's); None if neither
        sets any."""
        defaults = defaults or SLO()
        ttft = self.ttft_ms if self.ttft_ms is not None else defaults.ttft_ms
        tpot = self.tpot_ms if self.tpot_ms is not None else defaults.tpot_ms
        return None if ttft is None and tpot is None else SLO(ttft, tpot)

    def missed(self, ttft: float | None, tpot: float | None) -> str | None:
        """Which target a finished request missed, "ttft" before "tpot", given its TTFT
        and TPOT in seconds (TPOT None: one token, nothing to miss); None if it met both."""
        if self.ttft_ms is not None and (ttft is None or ttft * 1000 > self.ttft_ms):
            return "ttft"
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return "tpot"
        return None


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    """One image of a prompt: where its placeholder tokens sit and what fills them."""

    hash: str  # its content's digest: the encoder cache's key, and part of block hashes
    offset: int  # the prompt position of its first placeholder token
    length: int  # its placeholder tokens (the encoder's output rows)
    data: Any  # the processor's pixel_values [C, H, W] tensor; only the model runner reads it


class Request:
    """One sequence being generated.

    The scheduler owns `status` and `num_computed_tokens`; only
    `Scheduler.update_from_output` appends to `output_token_ids`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: dict[str, str] | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        pooling_params: PoolingParams | None = None,
        slo: SLO | None = None,
    ) -> None:
        """With `pooling_params` the request computes its prompt, whole in one step, and
        returns what its hidden states pool into (an embedding, a score) instead of
        tokens; its `sampling_params` are POOLING_SAMPLING. `slo`: its latency targets,
        the server's defaults filled in (None: none; see core/deadlines.py)."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Speculative method "draft": positions whose K/V the draft model holds (it
        # catches up on the rest when it next drafts; 0 again after a preemption).
        self.num_draft_computed = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at first admission
        self.first_scheduled_time: float | None = None  # stamped by the scheduler
        self.grammar: RequestGrammar | None = None  # structured outputs; set by the scheduler
        # Still before the grammar's start (SamplingParams.grammar_after): no mask yet.
        self.before_grammar = bool(sampling_params.grammar_after)
        self.lora_request = lora_request  # the adapter it runs under (None: the base model)
        self.trace_headers = trace_headers  # the caller's W3C trace context, if it sent one
        self.mm_features = mm_features or []  # its images, in prompt order
        self.pooling_params = pooling_params
        self.slo = slo

    @property
    def grammar_active(self) -> bool:
        """Whether its grammar masks its next token."""
        return self.grammar is not None and not self.before_grammar

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def reads_every_position(self) -> bool:
        """Whether its step must compute every prompt position (prompt logprobs, pooling
        over all tokens): no prefix-cache hits for it."""
        return self.sampling_params.prompt_logprobs is not None or self.pooling_params is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def copy_as(self, request_id: str, sampling_params: SamplingParams | None = None) -> Request:
        """A new waiting request with this one's tokens so far (nothing computed) and
        everything else of it; a beam's fork (core/beams.py)."""
        copy = Request(
            request_id,
            self.prompt_token_ids,
            sampling_params or self.sampling_params,
            self.priority,
            self.arrival_time,
            self.lora_request,
            self.trace_headers,
            self.mm_features,
            self.pooling_params,
            self.slo,
        )
        copy.all_token_ids = list(self.all_token_ids)
        copy.first_scheduled_time = self.first_scheduled_time
        return copy

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def features_in(self, start: int, end: int) -> list[MultiModalFeature]:
        """Its images (in prompt order) that positions start..end-1 cover."""
        return [f for f in self.mm_features if f.offset < end and f.offset + f.length > start]

    def stop_status(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Whether `token_id`, just appended, ends the request by its stop conditions
        (EOS, a stop token, max_tokens, the context); sets `stop_reason` for a stop token."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
