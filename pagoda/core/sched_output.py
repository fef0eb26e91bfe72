"""The contract between scheduler and model runner: plain dataclasses of integers
(and one array: the step's grammar bitmask)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.request import MultiModalFeature, Request
from pagoda.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's work this step: compute `token_ids` at positions
    `num_computed_tokens ...`, using the request's whole `block_ids`. With speculative
    decoding, the last `num_draft_tokens` of `token_ids` are drafts to verify."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    # None for a prefill chunk that ends before the last known token: nothing to sample.
    sampling_params: SamplingParams | None
    num_output_tokens: int = 0
    # Only for requests whose sampling looks at history (penalties, bad words):
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # Only for requests asking prompt logprobs: the prompt tokens that this chunk's
    # positions predict (position p scores token p + 1).
    prompt_logprob_targets: list[int] | None = None
    prompt_logprobs_n: int = 0  # top-N to report per prompt position
    num_draft_tokens: int = 0
    # Speculative method "draft": the drafts in `token_ids` are placeholders the runner
    # fills; the draft model first computes these known tokens, from position
    # `draft_input_start` (its K/V before that is current), then drafts.
    draft_input_ids: list[int] = field(default_factory=list)
    draft_input_start: int = 0
    # Under a grammar: its first row in SchedulerOutput.grammar_bitmask (one row per
    # sampled position: the last token's, then one after each draft).
    grammar_row: int | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under
    # The images whose placeholder positions this step computes (some or all of them).
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # A pooling request's, on its step (its whole prompt): pool its hidden states.
    pooling_params: PoolingParams | None = None

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model (as `Request.lora_int_id`)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    @classmethod
    def of(
        cls,
        request: Request,
        num_new: int,
        drafts: list[int],
        draft_inputs: tuple[list[int], int],
        block_ids: list[int],
    ) -> ScheduledRequest:
        """The request's work: `num_new` tokens from its computed ones, then `drafts`;
        `draft_inputs`: what a draft model computes first, and from where."""
        start = request.num_computed_tokens
        end = start + num_new
        params = request.sampling_params
        pools = request.pooling_params is not None
        samples = end == request.num_tokens and not pools
        history = params.needs_token_history and samples
        wants_prompt_logprobs = (
            params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1
        )
        return cls(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end] + list(drafts),
            num_computed_tokens=start,
            num_draft_tokens=len(drafts),
            draft_input_ids=draft_inputs[0],
            draft_input_start=draft_inputs[1],
            block_ids=block_ids,
            sampling_params=params if samples else None,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=request.prompt_token_ids if history else None,
            output_token_ids=request.output_token_ids if history else None,
            # Each position's logprobs score the token after it.
            prompt_logprob_targets=(
                request.all_token_ids[start + 1 : min(end, request.num_prompt_tokens - 1) + 1]
                if wants_prompt_logprobs
                else None
            ),
            prompt_logprobs_n=params.prompt_logprobs or 0,
            lora_request=request.lora_request,
            mm_features=request.features_in(start, end),
            pooling_params=request.pooling_params if pools else None,
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Block moves to do before the forward: swap-outs first (their blocks may be reused
    # this step), loads from the disk tier last (into blocks allocated this step).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), copy-on-write
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)  # (block, payload)
    # [rows, ceil(V / 32)] int32: allowed tokens of the rows sampled under a grammar.
    grammar_bitmask: np.ndarray | None = None
    # Encoder outputs the runner may drop (EncoderCacheManager evicted them).
    encoder_cache_evicted: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Exactly what came back from the device: per sampling request, its new token ids
    (one, or with speculation the accepted drafts and one sampled after them)."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per sampling request (same order), when any asked: per new token,
    # (chosen id, {token id: (logprob, rank)})
    logprobs: list[list[tuple[int, dict[int, tuple[float, int]]]] | None] | None = None
    # Request id -> per position of the chunk: {token id: (logprob, rank)}
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]]]] | None = None
    # Pooling request id -> what its hidden states pooled into (float32, on the host)
    pooled: dict[str, Any] | None = None

    @classmethod
    def merge(cls, parts: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        """One output for the requests of several partial runs of a step."""
        out = cls([], [])
        for part in parts:
            if part.logprobs is not None and out.logprobs is None:
                out.logprobs = [None] * len(out.request_ids)
            out.request_ids += part.request_ids
            out.sampled_token_ids += part.sampled_token_ids
            if out.logprobs is not None:
                out.logprobs += part.logprobs or [None] * len(part.request_ids)
            if part.prompt_logprobs:
                out.prompt_logprobs = {**(out.prompt_logprobs or {}), **part.prompt_logprobs}
            if part.pooled:
                out.pooled = {**(out.pooled or {}), **part.pooled}
        return out


@dataclass
class EngineCoreOutput:
    """What one step did to one request, for the output processor."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per new token: (chosen id, {token id: (logprob, rank)})
    logprobs: list[tuple[int, dict[int, tuple[float, int]]]] | None = None
    # (start position, per position {token id: (logprob, rank)})
    prompt_logprobs: tuple[int, list[dict[int, tuple[float, int]]]] | None = None
    scheduled_time: float | None = None  # set on the step that first scheduled the request
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0  # times the request was preempted so far
    cumulative_logprob: float | None = None  # a beam search's completion: its float32 sum

    @classmethod
    def of(
        cls,
        request_id: str,
        request: Request,
        start: int,
        token_ids: list[int] | None,
        logprobs,
        prompt_logprobs,
        scheduled_time: float | None,
    ) -> EngineCoreOutput | None:
        """What a step from position `start` did to `request` (known to the user's request
        as `request_id`); None for a prefill chunk with nothing to report."""
        if token_ids is None and prompt_logprobs is None and scheduled_time is None:
            return None
        return cls(
            request_id,
            token_ids or [],
            request.status.finish_reason,
            request.stop_reason,
            logprobs=logprobs[: len(token_ids)] if logprobs and token_ids else None,
            prompt_logprobs=(start, prompt_logprobs) if prompt_logprobs is not None else None,
            scheduled_time=scheduled_time,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
        )
