"""The fleet in simulated time: arrivals routed by the router's own policy code
(`pagoda.entrypoints.router.Router`: block hashes, the prefix table, the choice,
fed the replicas' KV events), replicas stepping their real schedulers, autoscaling
and failures, as one event queue. Simulated seconds cost what a step's scheduling
costs in Python, not what the step would.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from pagoda.entrypoints.router import Router, RouterConfig
from pagoda.errors import DeadlineUnmeetableError
from pagoda.sim.cost_model import StepCostModel
from pagoda.sim.replica import ReplicaSpec, SimReplica
from pagoda.sim.tier import TierStore
from pagoda.sim.workloads import SimRequest

_ARRIVE, _STEP_DONE, _UP, _FAIL, _SCALE = range(5)


@dataclass(frozen=True)
class FleetSpec:
    replicas: int = 2
    policy: str = "prefix"
    balance_threshold: int = 64  # the router's default
    prefix_table_size: int = 1 << 20
    kv_events: bool = True  # the router follows the replicas' prefix caches
    replica: ReplicaSpec = field(default_factory=ReplicaSpec)
    # Per request, besides the steps: the HTTP hops, tokenizing, detokenizing.
    request_overhead_s: float = 0.0
    # Autoscaling: every `scale_interval` s, a replica is added (ready after
    # `startup_delay` s) while waiting requests per replica exceed `scale_waiting` or
    # KV usage exceeds `scale_kv`, up to `max_replicas`; one is drained and removed
    # while none wait and KV usage is under a quarter of `scale_kv`, down to `replicas`.
    scale_waiting: float | None = None
    scale_kv: float | None = None
    max_replicas: int | None = None
    scale_interval: float = 10.0
    startup_delay: float = 60.0
    failures: tuple[tuple[float, int], ...] = ()  # (time, replica index) lost then
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # The disk KV tier (`pagoda serve --kv-offload-dir/--kv-offload-bytes`): 0 is off;
    # else each replica's budget, or with `kv_tier_shared` the fleet's one tier (one
    # directory every replica writes and reads). 2 GB/s: a plausible NVMe drive's
    # reads (the real tier read and checked 68.9 MB in 52 ms, 1.3 GB/s, from the page
    # cache on the 2-core EPYC of docs/perf/kv_tier.json).
    kv_tier_bytes: int = 0
    kv_tier_shared: bool = False
    kv_tier_read_gbps: float = 2.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}.")
        if self.kv_tier_bytes < 0 or not self.kv_tier_read_gbps > 0:
            raise ValueError("kv_tier_bytes must be >= 0 and kv_tier_read_gbps > 0.")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError("max_replicas must be >= replicas.")


@dataclass
class _Tracked:
    arrival: float
    output_len: int
    replica: int = -1
    first_token: float | None = None
    finish: float | None = None
    tokens: int = 0
    failed: bool = False
    refused: bool = False  # by a replica's deadlines (429)


class Simulation:
    def __init__(self, fleet: FleetSpec, cost: StepCostModel, reqs: list[SimRequest]):
        self.fleet, self.cost, self.reqs = fleet, cost, reqs
        self.config = RouterConfig(
            backends=tuple(_url(i) for i in range(fleet.replicas)),
            policy=fleet.policy,
            block_size=fleet.replica.block_size,
            balance_threshold=fleet.balance_threshold,
            prefix_table_size=fleet.prefix_table_size,
            kv_events=fleet.kv_events,
        )
        self.router = Router(self.config)
        self._router_replicas = {_index(r.url): r for r in self.router.replicas}
        self.replicas: list[SimReplica] = []
        self.tier_stores: list[TierStore] = []  # one, shared, or one a replica
        self.started: list[float] = []  # when each replica was provisioned
        self.stopped: list[float | None] = []
        for _ in range(fleet.replicas):
            self._provision(0.0)
        self.events: list = []
        self._seq = itertools.count()
        self.tracked = [_Tracked(r.arrival, r.output_len) for r in reqs]
        self.now = 0.0
        self.scale_log: list[tuple[float, int]] = [(0.0, fleet.replicas)]
        self._draining: set[int] = set()

    # ---- the event queue ------------------------------------------------------------

    def _push(self, time: float, kind: int, data: int) -> None:
        heapq.heappush(self.events, (time, next(self._seq), kind, data))

    def run(self, progress=None) -> dict:
        for i, r in enumerate(self.reqs):
            self._push(r.arrival, _ARRIVE, i)
        for time, index in self.fleet.failures:
            self._push(time, _FAIL, index)
        if self.fleet.scale_waiting is not None or self.fleet.scale_kv is not None:
            self._push(self.fleet.scale_interval, _SCALE, 0)
        done = 0
        while self.events:
            self.now, _, kind, data = heapq.heappop(self.events)
            if kind == _ARRIVE:
                done += self._arrive(data)  # (refused at once: done)
            elif kind == _STEP_DONE:
                finished = self._step_done(data)
                done += finished
                if progress is not None and finished:
                    progress.update(finished)
            elif kind == _UP:
                self._up(data)
            elif kind == _FAIL:
                done += self._fail(data)
            elif kind == _SCALE and done < len(self.reqs):
                self._scale()
                self._push(self.now + self.fleet.scale_interval, _SCALE, 0)
        return self.results()

    # ---- requests -------------------------------------------------------------------

    def _arrive(self, i: int) -> int:
        req, tracked = self.reqs[i], self.tracked[i]
        hashes = self.router.block_hashes({"prompt": req.prompt})
        choice = self.router.choose(hashes)
        if choice is None:  # no replica up: refused (503)
            tracked.failed = True
            return 1
        self.router.record(hashes, choice)
        replica = self.replicas[_index(choice.url)]
        tracked.replica = replica.index
        try:
            replica.add(str(i), req.prompt, req.output_len, self.now)
        except DeadlineUnmeetableError:  # refused (429): shed before it queued
            tracked.refused = True
            return 1
        choice.in_flight += 1
        if replica.step_in_flight is None:
            self._start(replica)
        return 0

    def _start(self, replica: SimReplica) -> None:
        seconds = replica.start_step()
        if seconds is not None:
            self._push(self.now + seconds, _STEP_DONE, replica.index)

    def _step_done(self, index: int) -> int:
        replica = self.replicas[index]
        if not replica.alive or replica.step_in_flight is None:
            return 0  # lost with its replica
        finished = 0
        for out in replica.finish_step():
            tracked = self.tracked[int(out.request_id)]
            if out.new_token_ids:
                if tracked.first_token is None:
                    tracked.first_token = self.now
                tracked.tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                tracked.finish = self.now
                self._router_replica(index).in_flight -= 1
                finished += 1
        if self.fleet.kv_events and (batch := replica.take_kv_events()):  # (most are empty)
            router_replica = self._router_replica(index)
            self.router.apply_kv_events(router_replica, router_replica.times_down, batch)
        if index in self._draining and not replica.scheduler.has_unfinished_requests():
            self._remove(index)
        else:
            self._start(replica)
        return finished

    # ---- the fleet ------------------------------------------------------------------

    def _provision(self, now: float) -> SimReplica:
        fleet, store = self.fleet, None
        if fleet.kv_tier_bytes:
            if not fleet.kv_tier_shared or not self.tier_stores:  # (a new replica: empty)
                block_bytes = fleet.replica.kv_bytes_per_token * fleet.replica.block_size
                self.tier_stores.append(TierStore(fleet.kv_tier_bytes, block_bytes))
            store = self.tier_stores[-1]
        replica = SimReplica(len(self.replicas), fleet.replica, self.cost, fleet.kv_events,
                             lambda: self.now, store, fleet.kv_tier_read_gbps)  # fmt: skip
        self.replicas.append(replica)
        self.started.append(now)
        self.stopped.append(None)
        return replica

    def _router_replica(self, index: int):
        return self._router_replicas[index]

    def _set_urls(self, urls: list[str]) -> None:
        self.router.replica_set.set_urls(urls)
        for r in self.router.replicas:  # the router's own record of each replica
            self._router_replicas[_index(r.url)] = r
        self.scale_log.append((self.now, len(self.router.replicas)))

    def _live(self) -> list[SimReplica]:
        return [r for r in self.replicas if r.alive and self.stopped[r.index] is None
                and r.index not in self._draining]  # fmt: skip

    def _up(self, index: int) -> None:
        self._set_urls([r.url for r in self.router.replicas] + [_url(index)])

    def _fail(self, index: int) -> int:
        """Replica `index` lost: what it held fails (its streams), the router marks it
        down; it does not come back (autoscaling may add another)."""
        if index >= len(self.replicas) or not self.replicas[index].alive:
            return 0
        replica = self.replicas[index]
        replica.alive = False
        self.stopped[index] = self.now
        self.router.set_health(self._router_replica(index), False)
        lost = 0
        for request_id in list(replica.scheduler.requests):
            tracked = self.tracked[int(request_id)]
            if tracked.finish is None:
                tracked.failed = True
                lost += 1
        return lost

    def _scale(self) -> None:
        fleet, live = self.fleet, self._live()
        if not live:
            return
        waiting = sum(r.num_waiting for r in live) / len(live)
        usage = sum(r.kv_usage for r in live) / len(live)
        pending = sum(1 for s in self.stopped if s is None) - len(self.router.replicas)
        total = len(live) + max(0, pending)
        busy = (fleet.scale_waiting is not None and waiting > fleet.scale_waiting) or (
            fleet.scale_kv is not None and usage > fleet.scale_kv
        )
        if busy and total < (fleet.max_replicas or total):
            replica = self._provision(self.now)
            self._push(self.now + fleet.startup_delay, _UP, replica.index)
        elif waiting == 0 and usage < (fleet.scale_kv or 0.8) / 4 and len(live) > fleet.replicas:
            victim = min(live[1:], key=lambda r: self._router_replica(r.index).in_flight)
            self._draining.add(victim.index)
            self.router.set_health(self._router_replica(victim.index), False)
            if not victim.scheduler.has_unfinished_requests():
                self._remove(victim.index)

    def _remove(self, index: int) -> None:
        self._draining.discard(index)
        self.stopped[index] = self.now
        self._set_urls([r.url for r in self.router.replicas if r.url != _url(index)])

    # ---- results --------------------------------------------------------------------

    def results(self) -> dict:
        fleet = self.fleet
        done = [t for t in self.tracked if t.finish is not None and not t.failed]
        overhead = fleet.request_overhead_s
        ttft = np.array([t.first_token - t.arrival + overhead for t in done])
        tpot = np.array([(t.finish - t.first_token) / (t.tokens - 1) for t in done if t.tokens > 1])
        e2e = np.array([t.finish - t.arrival + overhead for t in done])
        start = min((t.arrival for t in self.tracked), default=0.0)
        end = max((t.finish for t in done), default=start)
        duration = max(end - start, 1e-9)
        good = [
            t for t in done
            if (fleet.slo_ttft_ms is None or (t.first_token - t.arrival + overhead) * 1e3 <= fleet.slo_ttft_ms)
            and (fleet.slo_tpot_ms is None or t.tokens < 2
                 or (t.finish - t.first_token) / (t.tokens - 1) * 1e3 <= fleet.slo_tpot_ms)
        ]  # fmt: skip
        queries = sum(r.kv.prefix_cache_queries for r in self.replicas)
        hits = sum(r.kv.prefix_cache_hits for r in self.replicas)
        replica_seconds = sum((stop if stop is not None else end) - begin
                              for begin, stop in zip(self.started, self.stopped, strict=True))  # fmt: skip
        return {
            "completed": len(done),
            "failed": sum(t.failed for t in self.tracked),
            "refused": sum(t.refused for t in self.tracked),
            "duration_s": duration,
            "request_throughput": len(done) / duration,
            "output_throughput": sum(t.tokens for t in done) / duration,
            "goodput": len(good) / duration,
            "ttft_ms": _summary(ttft),
            "tpot_ms": _summary(tpot),
            "e2el_ms": _summary(e2e),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "replica_seconds": replica_seconds,
            "max_replicas": max(n for _, n in self.scale_log),
            "replicas_over_time": self.scale_log,
            "busy_fraction": sum(r.busy_seconds for r in self.replicas)
            / max(replica_seconds, 1e-9),
            "kv_tier": self._tier_results(queries) if self.tier_stores else None,
        }

    def _tier_results(self, queries: int) -> dict:
        """The disk tier's part: prompt tokens read from it instead of computed (of
        those looked up), blocks found of those looked up there, bytes each way."""
        per_replica = [
            {"hit_tokens": r.kv.tier_hits, "bytes_written": r.tier.stats.bytes_written,
             "bytes_read": r.tier.stats.bytes_read}
            for r in self.replicas
        ]  # fmt: skip
        stats = [r.tier.stats for r in self.replicas]
        hit_tokens = sum(r["hit_tokens"] for r in per_replica)
        lookups = sum(s.queries for s in stats)
        return {
            "shared": self.fleet.kv_tier_shared,
            "hit_tokens": hit_tokens,
            "hit_rate": hit_tokens / queries if queries else 0.0,
            "block_hit_rate": sum(s.hits for s in stats) / lookups if lookups else 0.0,
            "bytes_written": sum(s.bytes_written for s in stats),
            "bytes_read": sum(s.bytes_read for s in stats),
            "read_s": sum(s.load_seconds for s in stats),
            "stored_bytes": sum(s.num_bytes for s in self.tier_stores),
            "evicted_blocks": sum(s.blocks_removed for s in self.tier_stores),
            "per_replica": per_replica,
        }


def _summary(seconds: np.ndarray) -> dict:
    if seconds.size == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = seconds * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "p90": float(np.quantile(ms, 0.9)), "p99": float(np.quantile(ms, 0.99))}  # fmt: skip


def _url(index: int) -> str:
    return f"sim://replica-{index}"


def _index(url: str) -> int:
    return int(url.rsplit("-", 1)[1])
