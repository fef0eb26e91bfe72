"""A simulated engine replica: pagoda's own `Scheduler` and `KVCacheManager` (the
prefix cache, chunked prefill, preemption, the disk tier's lookups and saves, exactly
as an engine runs them), with a stand-in for the model whose step takes what the cost
model says (plus the step's tier reads at the tier's bandwidth) and samples one
token per sampling row."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagoda.core.scheduler import Scheduler
from pagoda.core.step_shape import StepShape
from pagoda.request import SLO, Request
from pagoda.sampling_params import SamplingParams
from pagoda.sim.cost_model import StepCostModel
from pagoda.sim.tier import SimTier, TierStore

SAMPLED_TOKEN = 7  # what the stand-in samples (outputs are never read, only counted)


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica's engine settings (as `pagoda serve` flags would set them)."""

    kv_tokens: int = 65536  # what its KV cache holds
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 16384
    # The server's latency targets (--slo-ttft-ms/--slo-tpot-ms): the slack order and
    # load shedding of pagoda/core/deadlines.py, on the simulated clock.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # A token's K/V, for the disk tier's bytes: the shipped cost model's SmolLM2-135M
    # in bfloat16 (30 layers x 3 KV heads x 64 x K and V x 2 bytes).
    kv_bytes_per_token: int = 23040

    def __post_init__(self) -> None:
        if self.kv_tokens < self.block_size or self.max_num_seqs < 1:
            raise ValueError("kv_tokens must hold a block and max_num_seqs be >= 1.")


class SimReplica:
    def __init__(
        self,
        index: int,
        spec: ReplicaSpec,
        cost: StepCostModel,
        kv_events: bool,
        clock,
        tier_store: TierStore | None = None,
        tier_read_gbps: float = 2.0,
    ) -> None:
        """`clock()`: the simulated time (the deadlines' clock). `tier_store`: the disk
        tier's index this replica writes to and reads from (its own, or shared)."""
        self.index = index
        self.cost = cost
        self.tier = SimTier(tier_store) if tier_store is not None else None
        self.tier_read_bytes_per_s = tier_read_gbps * 1e9
        self._bytes_read_billed = 0  # tier reads already added to a step's time
        self.kv = KVCacheManager(
            spec.kv_tokens // spec.block_size, spec.block_size, True, tier=self.tier
        )
        config = SchedulerConfig(
            spec.max_num_seqs, spec.max_num_batched_tokens, spec.max_model_len,
            slo_ttft_ms=spec.slo_ttft_ms, slo_tpot_ms=spec.slo_tpot_ms,
        )  # fmt: skip
        self.scheduler = Scheduler(config, self.kv)
        self.scheduler.deadlines.clock = clock
        has_slo = spec.slo_ttft_ms is not None or spec.slo_tpot_ms is not None
        self.slo = SLO(spec.slo_ttft_ms, spec.slo_tpot_ms) if has_slo else None
        if kv_events:
            self.kv.start_kv_events()
        self.step_in_flight: SchedulerOutput | None = None
        self.alive = True
        self.busy_seconds = 0.0

    def add(self, request_id: str, prompt: list[int], output_len: int, now: float) -> None:
        """Queue a request; DeadlineUnmeetableError (nothing queued) when its targets
        cannot be met, as the engine's front door would answer 429."""
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        request = Request(request_id, prompt, params, arrival_time=now, slo=self.slo)
        self.scheduler.add_request(request)

    def start_step(self) -> float | None:
        """Schedule a step; its duration, or None when there is nothing to run."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        self.step_in_flight = out
        seconds = self.cost.seconds(StepShape.of(out))
        if self.tier is not None:  # read on the engine thread as requests were admitted
            stats = self.tier.stats
            read_seconds = (stats.bytes_read - self._bytes_read_billed) / self.tier_read_bytes_per_s
            self._bytes_read_billed = stats.bytes_read
            stats.load_seconds += read_seconds
            seconds += read_seconds
        self.busy_seconds += seconds
        self.scheduler.deadlines.record_step(out, seconds)  # what the engine would measure
        return seconds

    def finish_step(self) -> list[EngineCoreOutput]:
        out, self.step_in_flight = self.step_in_flight, None
        sampling = [item.request_id for item in out.scheduled if item.sampling_params is not None]
        runner_output = ModelRunnerOutput(
            request_ids=sampling, sampled_token_ids=[[SAMPLED_TOKEN]] * len(sampling)
        )
        return self.scheduler.update_from_output(out, runner_output)

    def take_kv_events(self):
        return self.kv.take_kv_events()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        pool = self.kv.block_pool
        return pool.num_used_blocks / pool.num_blocks
