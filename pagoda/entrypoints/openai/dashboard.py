"""The live dashboard: `GET /dashboard` (one HTML page, no external assets) fed by
`GET /dashboard/events` (server-sent events).

One `DashboardFeed` per server samples the engine every `interval` seconds, and
only while a page is connected: each sample is one `TakeSnapshot` operation,
applied by the engine thread between two steps (the KV block map, the requests'
progress, the stats; about 1 ms with 11,650 blocks and 64 requests), so the step loop pays
nothing when nobody watches and one snapshot per interval however many watch.
A sample is broadcast to every page; the last `history_seconds` of samples
(without the block map and requests) go to a page when it connects, so its
charts start filled.

TTFT comes from the requests that got their first token in the interval, TPOT
from those that finished in it; both are recorded on the engine thread by a
stat logger that keeps nothing while no page is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict
from importlib import resources

from pagoda.core.stats import IterationStats, RequestProgress, SchedulerStats
from pagoda.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = 0.5  # seconds between samples


def dashboard_html() -> str:
    return resources.files("pagoda.entrypoints.openai").joinpath("dashboard.html").read_text()


class LatencyRecorder:
    """A stat logger (engine thread) that keeps the TTFTs and TPOTs the feed has not
    read yet, while `active`; deques, so the feed's thread can pop them safely."""

    MAX_KEPT = 65536  # per kind: bounded even if the feed stalls

    def __init__(self) -> None:
        self.active = False
        self.ttfts: deque[float] = deque(maxlen=self.MAX_KEPT)
        self.tpots: deque[float] = deque(maxlen=self.MAX_KEPT)

    def start(self) -> None:
        self.ttfts.clear()
        self.tpots.clear()
        self.active = True

    def record(self, stats: IterationStats) -> None:
        if not self.active:
            return
        self.ttfts.extend(stats.time_to_first_tokens)
        self.tpots.extend(
            r.time_per_output_token
            for r in stats.finished_requests
            if r.time_per_output_token is not None
        )

    def drain(self) -> tuple[list[float], list[float]]:
        return _drain(self.ttfts), _drain(self.tpots)


def _drain(values: deque[float]) -> list[float]:
    out = []
    with contextlib.suppress(IndexError):
        for _ in range(len(values)):
            out.append(values.popleft())
    return out


def _quantile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000.0 * ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class DashboardFeed:
    def __init__(
        self,
        engine: AsyncEngine,
        interval: float = DEFAULT_INTERVAL,
        history_seconds: float = 300.0,
    ) -> None:
        self.engine = engine
        self.interval = interval
        self.history: deque[dict] = deque(maxlen=max(1, int(history_seconds / interval)))
        self.recorder = LatencyRecorder()
        # Appending from this thread while the engine thread iterates the list is safe
        # in CPython: the engine sees the recorder from its next step on.
        engine.engine.stat_loggers.append(self.recorder)
        self._subscribers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None
        self._previous: tuple[float, SchedulerStats] | None = None  # the last sample's

    def info(self) -> dict:
        """What the page shows once: the model and the cache's shape."""
        stats = self.engine.get_stats()
        kv = stats.kv_cache
        return {
            "model": self.engine.model_name,
            "interval": self.interval,
            "block_size": kv.block_size,
            "num_blocks": kv.num_blocks_total,
            "kv_cache_dtype": kv.dtype,
            "max_model_len": self.engine.max_model_len,
        }

    async def events(self) -> AsyncIterator[str]:
        """One page's event stream: `info`, then `history`, then a `sample` per interval."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=4)
        self._subscribers.add(queue)
        if self._task is None or self._task.done():
            self.recorder.start()
            self._previous = None  # rates start over, not across the time nobody watched
            self._task = asyncio.create_task(self._sample_loop())
        try:
            yield _event("info", self.info())
            yield _event("history", list(self.history))
            while True:
                sample = await queue.get()
                yield _event("sample", sample)
                if "error" in sample:  # the engine stopped: end the stream
                    return
        finally:
            self._subscribers.discard(queue)

    async def _sample_loop(self) -> None:
        try:
            while self._subscribers:
                started = time.monotonic()
                try:
                    if not self.engine.accepting:  # stopping: let the server close
                        raise RuntimeError("the server is stopping.")
                    sample = await self._sample()
                except Exception as e:  # a dead or stopping engine: the pages say so
                    sample = {"t": time.time(), "error": str(e) or type(e).__name__}
                for queue in list(self._subscribers):
                    if queue.full():  # a page that cannot keep up skips a sample
                        queue.get_nowait()
                    queue.put_nowait(sample)
                if "error" in sample:
                    break
                elapsed = time.monotonic() - started
                await asyncio.sleep(max(0.0, self.interval - elapsed))
        finally:
            self.recorder.active = False
            self._task = None

    async def _sample(self) -> dict:
        snapshot, cost = await self.engine.snapshot()
        now = time.monotonic()
        stats = snapshot.stats
        kv = stats.kv_cache
        ttfts, tpots = self.recorder.drain()
        sample = {
            "t": time.time(),
            "running": stats.num_requests_running,
            "waiting": stats.num_requests_waiting,
            "swapped": kv.num_requests_swapped,
            "kv_usage_perc": kv.usage_perc,
            "fragmentation_perc": stats.kv_cache_fragmentation_perc,
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
            "num_preemptions": stats.num_preemptions,
            "generation_tps": None,
            "prompt_tps": None,
            "preemptions_per_s": None,
            "ttft_p50_ms": _quantile_ms(ttfts, 0.5),
            "ttft_p99_ms": _quantile_ms(ttfts, 0.99),
            "tpot_p50_ms": _quantile_ms(tpots, 0.5),
            "tpot_p99_ms": _quantile_ms(tpots, 0.99),
            "snapshot_ms": 1000.0 * cost,
        }
        if self._previous is not None:
            then, before = self._previous
            dt = max(now - then, 1e-6)
            sample["generation_tps"] = (
                stats.num_generation_tokens - before.num_generation_tokens
            ) / dt
            sample["prompt_tps"] = (stats.num_prompt_tokens - before.num_prompt_tokens) / dt
            sample["preemptions_per_s"] = (stats.num_preemptions - before.num_preemptions) / dt
        self._previous = (now, stats)
        self.history.append(sample)
        return {
            **sample,
            "block_map": snapshot.block_map,
            "num_requests": snapshot.num_requests,
            "requests": [_progress(r, now) for r in snapshot.requests],
        }


def _progress(r: RequestProgress, now: float) -> dict:
    out = asdict(r)
    out["age_s"] = now - out.pop("arrival_time")
    return out


def _event(kind: str, data) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
