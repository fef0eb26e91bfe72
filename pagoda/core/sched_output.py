"""The contract between scheduler and model runner: plain dataclasses of integers."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's work this step: compute `token_ids` at positions
    `num_computed_tokens ...`, using the request's whole `block_ids`."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    # None for a prefill chunk that ends before the last known token: nothing to sample.
    sampling_params: SamplingParams | None
    num_output_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Exactly what came back from the device: one sampled id per sampling request."""

    request_ids: list[str]
    sampled_token_ids: list[int]


@dataclass
class EngineCoreOutput:
    """What one step did to one request, for the output processor."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
