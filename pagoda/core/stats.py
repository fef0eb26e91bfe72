"""Typed stats, each built by the part that owns the numbers.

`KVCacheStats` comes from the `KVCacheManager`, `SchedulerStats` from the
`Scheduler` (with the KV snapshot inside); `LLMEngine.get_stats()` returns
the latter. Counters (`num_*_tokens`, preemptions, prefix-cache queries and
hits) are cumulative since the engine started; the rest are current values.
`IterationStats` come from the output processor, per step, and feed the
metrics' latency histograms and token counters.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.core.kv_tier import TierStats
from pagoda.outputs import RequestMetrics
from pagoda.request import SLO, Request, RequestStatus

if TYPE_CHECKING:
    from pagoda.core.scheduler import Scheduler


@dataclass(frozen=True)
class KVCacheStats:
    dtype: str  # what a block holds: the model's dtype, "int8" or "fp8_e4m3"
    block_size: int  # tokens a block holds
    num_blocks_total: int
    num_blocks_used: int
    num_requests_swapped: int  # requests whose blocks sit in the host pool
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    bytes_per_token: int = 0  # a token's K/V (every layer, every worker's shard)
    # What K and V of every head would take: more than bytes_per_token where the cache
    # holds multi-head latent attention's latent rows instead.
    expanded_bytes_per_token: int = 0
    tier: TierStats | None = None  # the disk tier's, where there is one
    tier_hit_tokens: int = 0  # of prefix_cache_hits, tokens loaded from the tier

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks_total * self.block_size

    @property
    def usage_perc(self) -> float:
        return 100.0 * self.num_blocks_used / self.num_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass
class SpecDecodingStats:
    """Speculative decoding since start: drafts proposed, accepted, and tokens emitted
    by the steps that verified them (accepted drafts plus one sampled token each)."""

    num_drafts: int  # request-steps that verified drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    # Position i (0-based) of a draft: how often one was proposed there, and accepted.
    num_drafted_per_pos: list[int]
    num_accepted_per_pos: list[int]

    @classmethod
    def empty(cls, num_speculative_tokens: int) -> SpecDecodingStats:
        return cls(0, 0, 0, 0, [0] * num_speculative_tokens, [0] * num_speculative_tokens)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for i in range(num_draft_tokens):  # at most k: a few per request-step
            self.num_drafted_per_pos[i] += 1
            self.num_accepted_per_pos[i] += i < num_accepted

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.num_emitted_tokens,
            list(self.num_drafted_per_pos),
            list(self.num_accepted_per_pos),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(
                self.num_accepted_per_pos, self.num_drafted_per_pos, strict=True
            )
        ]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying request-step (1 means no draft ever accepted)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class LoRAStats:
    """With LoRA on: which adapters the requests use (vLLM's lora_requests_info)."""

    max_loras: int
    running_adapters: tuple[str, ...]  # adapter names of running requests, sorted
    waiting_adapters: tuple[str, ...]  # of requests waiting to run
    num_resident: int = 0  # adapters in the model's slots (the model runner's count)


@dataclass(frozen=True)
class SchedulerStats:
    num_requests_running: int  # sequences in the running batch (a request with n > 1 counts n)
    num_requests_waiting: int  # sequences waiting to run, swapped ones not included
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int  # tokens sampled
    # Of the slots in running requests' blocks, the percentage holding no token yet.
    kv_cache_fragmentation_perc: float
    kv_cache: KVCacheStats
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on
    lora: LoRAStats | None = None  # with LoRA on
    # Images: lookups of a request's image in the encoder cache, and those found held.
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    # Requests refused as unable to meet their latency targets, by target, and the step
    # cost estimate admission goes by (seconds; core/deadlines.py's StepCost).
    num_slo_refused_ttft: int = 0
    num_slo_refused_tpot: int = 0
    step_cost_base: float = 0.0
    step_cost_per_decode_row: float = 0.0
    step_cost_per_prefill_token: float = 0.0
    step_cost_prefill_stall: float = 0.0

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap


@dataclass(frozen=True)
class RequestProgress:
    """Where one sequence stands, for the dashboard."""

    request_id: str
    state: str  # "running" | "waiting" | "preempted" | "swapped"
    priority: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int | None
    num_blocks: int  # device blocks it holds
    lora_name: str  # "" for the base model
    arrival_time: float  # time.monotonic()

    @classmethod
    def of(cls, r: Request, state: str, num_blocks: int) -> RequestProgress:
        lora_name = r.lora_request.lora_name if r.lora_request is not None else ""
        return cls(
            r.request_id, state, r.priority, r.num_prompt_tokens, r.num_computed_tokens,
            r.num_output_tokens, r.sampling_params.max_tokens, num_blocks, lora_name,
            r.arrival_time,
        )  # fmt: skip


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine between two steps: its stats, every KV block's state (one character
    each, see `BlockPool.block_map`) and its requests, running first (in the order
    they would be preempted last to first), then waiting in the order they would run."""

    stats: SchedulerStats
    block_map: str
    requests: list[RequestProgress]
    num_requests: int  # all unfinished sequences; `requests` may hold fewer


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_generation_tokens: int  # over all completions
    e2e_latency: float  # seconds from arrival to finish
    # Mean seconds per output token after the first, when there were at least two.
    time_per_output_token: float | None
    lora_name: str = ""  # the adapter it ran under ("" for the base model)
    request_id: str = ""
    timeline: RequestMetrics | None = None  # arrival, first scheduled, first token, finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0  # over all its completions
    trace_headers: dict[str, str] | None = None  # the caller's W3C trace context
    slo: SLO | None = None  # its latency targets, if it had any

    @property
    def time_to_first_token(self) -> float | None:
        t = self.timeline
        return (
            None if t is None or t.first_token_time is None else t.first_token_time - t.arrival_time
        )

    @property
    def slo_missed(self) -> str | None:
        """The target it missed ("ttft", then "tpot"); None if it met them (or had none)."""
        if self.slo is None:
            return None
        return self.slo.missed(self.time_to_first_token, self.time_per_output_token)


@dataclass
class IterationStats:
    """What one engine step (or an abort) did to requests' timelines, for the metrics.
    Built by the output processor, which owns each request's timeline."""

    num_prompt_tokens: int = 0  # of requests that got their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)  # arrival -> first scheduled
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


def scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    """The scheduler's numbers, with the KV cache manager's and its parts'."""
    kv = scheduler.kv_cache_manager
    kv_stats = kv.stats()
    allocated_slots = kv_stats.num_blocks_used * kv.block_size
    empty_slots = sum(
        kv.num_blocks_of(r.request_id) * kv.block_size - r.num_computed_tokens
        for r in scheduler.running
    )
    return SchedulerStats(
        num_requests_running=len(scheduler.running),
        num_requests_waiting=len(scheduler.requests)
        - len(scheduler.running)
        - kv_stats.num_requests_swapped,
        num_preemptions_recompute=scheduler.num_preemptions["recompute"],
        num_preemptions_swap=scheduler.num_preemptions["swap"],
        num_prompt_tokens=scheduler.num_prompt_tokens_computed,
        num_generation_tokens=scheduler.num_generation_tokens,
        kv_cache_fragmentation_perc=100.0 * empty_slots / allocated_slots
        if allocated_slots
        else 0.0,
        kv_cache=kv_stats,
        spec_decoding=scheduler.drafts.stats.snapshot() if scheduler.drafts is not None else None,
        lora=scheduler.loras.stats(scheduler.requests.values())
        if scheduler.loras is not None
        else None,
        mm_cache_queries=scheduler.images.queries,
        mm_cache_hits=scheduler.images.hits,
        num_slo_refused_ttft=scheduler.deadlines.num_refused["ttft"],
        num_slo_refused_tpot=scheduler.deadlines.num_refused["tpot"],
        step_cost_base=scheduler.deadlines.cost.base,
        step_cost_per_decode_row=scheduler.deadlines.cost.per_decode_row,
        step_cost_per_prefill_token=scheduler.deadlines.cost.per_prefill_token,
        step_cost_prefill_stall=scheduler.deadlines.cost.prefill_stall,
    )


def progress(scheduler: Scheduler, limit: int) -> list[RequestProgress]:
    """At most `limit` sequences: running ones first, then the waiting queue in
    order, then those waiting elsewhere (for a grammar, or to fork)."""
    kv = scheduler.kv_cache_manager
    shown: dict[str, Request] = {}
    for r in itertools.chain(scheduler.running, scheduler.waiting, scheduler.requests.values()):
        if len(shown) >= limit:
            break
        shown.setdefault(r.request_id, r)
    out = []
    for r in shown.values():
        state = r.status.name.lower()
        if r.status == RequestStatus.PREEMPTED and kv.is_swapped(r):
            state = "swapped"
        out.append(RequestProgress.of(r, state, kv.num_blocks_of(r.request_id)))
    return out
