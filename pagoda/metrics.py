"""Prometheus metrics for one engine, vLLM's names with the `pagoda:` prefix.

Every `EngineMetrics` owns its own `CollectorRegistry` (no global state), so
two engines or two servers can live in one process. Two kinds of values:

- request timelines, from the `IterationStats` the engine hands to `record()`
  after each step (it is one of the engine's stat loggers): latencies, token
  counts, finished requests; prometheus_client's own Counter/Histogram, which
  are thread-safe (the engine thread records them, the HTTP thread scrapes);
- owned by the engine (`num_requests_running`, KV usage, preemptions, prefix
  cache counters): read at scrape time from the latest stats snapshot through
  `stats_fn`, so they are never copied twice nor out of step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.core.stats import (
    IterationStats,
    KVCacheStats,
    LoRAStats,
    SchedulerStats,
    SpecDecodingStats,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# Read from the engine's `SchedulerStats` at scrape time: name -> (help, value).
_GAUGES: dict[str, tuple[str, Callable[[SchedulerStats], float]]] = {
    "pagoda:num_requests_running": (
        "Sequences in the running batch.",
        lambda s: s.num_requests_running,
    ),
    "pagoda:num_requests_waiting": (
        "Sequences waiting to be scheduled.",
        lambda s: s.num_requests_waiting,
    ),
    "pagoda:num_requests_swapped": (
        "Sequences swapped out to host memory.",
        lambda s: s.kv_cache.num_requests_swapped,
    ),
    # `_perc` gauges are fractions, as vLLM's: 1 means 100 percent.
    "pagoda:kv_cache_usage_perc": (
        "KV cache usage, the fraction of blocks in use (1 means 100 percent).",
        lambda s: s.kv_cache.usage_perc / 100,
    ),
    "pagoda:kv_cache_fragmentation_perc": (
        "The fraction of the slots in running requests' blocks that hold no token.",
        lambda s: s.kv_cache_fragmentation_perc / 100,
    ),
    "pagoda:num_blocks_used": ("KV cache blocks in use.", lambda s: s.kv_cache.num_blocks_used),
    "pagoda:num_blocks_total": ("KV cache blocks in all.", lambda s: s.kv_cache.num_blocks_total),
    "pagoda:kv_cache_bytes_per_token": (
        "Bytes a token's K/V takes in the cache (every layer).",
        lambda s: s.kv_cache.bytes_per_token,
    ),
    "pagoda:kv_cache_expanded_bytes_per_token": (
        "Bytes K and V of every head would take per token: above kv_cache_bytes_per_token "
        "where the cache holds multi-head latent attention's latent rows.",
        lambda s: s.kv_cache.expanded_bytes_per_token,
    ),
    "pagoda:prefix_cache_hit_rate": (
        "Prefix cache hits / queries, in tokens, since start.",
        lambda s: s.kv_cache.prefix_cache_hit_rate,
    ),
    # The measured step cost that latency targets are checked against (core/deadlines.py).
    "pagoda:step_cost_base_seconds": (
        "Estimated fixed cost of a step (decode-only steps' least-squares intercept).",
        lambda s: s.step_cost_base,
    ),
    "pagoda:step_cost_decode_row_seconds": (
        "Estimated cost of each decode row in a step.",
        lambda s: s.step_cost_per_decode_row,
    ),
    "pagoda:step_cost_prefill_token_seconds": (
        "Estimated cost of each prefill token in a step.",
        lambda s: s.step_cost_per_prefill_token,
    ),
    "pagoda:step_cost_prefill_stall_seconds": (
        "Recent mean prefill time in steps that decode (what a decoding request waits).",
        lambda s: s.step_cost_prefill_stall,
    ),
}
# Cumulative in the engine; names without the _total suffix.
_COUNTERS: dict[str, tuple[str, Callable[[SchedulerStats], float]]] = {
    "pagoda:num_preemptions": ("Preemptions since start.", lambda s: s.num_preemptions),
    "pagoda:prefix_cache_queries": (
        "Prefix cache queries, in tokens.",
        lambda s: s.kv_cache.prefix_cache_queries,
    ),
    "pagoda:prefix_cache_hits": (
        "Prefix cache hits, in tokens.",
        lambda s: s.kv_cache.prefix_cache_hits,
    ),
    # vLLM's names: a request's image looked up in the encoder cache, and found there.
    "pagoda:mm_cache_queries": ("Encoder cache queries, in images.", lambda s: s.mm_cache_queries),
    "pagoda:mm_cache_hits": ("Encoder cache hits, in images.", lambda s: s.mm_cache_hits),
}


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > max_model_len:
                return tuple(float(b) for b in buckets)
            buckets.append(value)
        scale *= 10


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, stats_fn: Callable[[], SchedulerStats]) -> None:
        self.model_name = model_name
        self.stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        stats = self.stats_fn()
        for name, (doc, value) in _GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value(stats)))
            yield family
        for name, (doc, value) in _COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value(stats)))
            yield family
        if stats.spec_decoding is not None:
            yield from self._spec_decoding(stats.spec_decoding)
        if stats.lora is not None:
            yield from self._lora(stats.lora)
        if stats.kv_cache.tier is not None:
            yield from self._tier(stats.kv_cache)
        refused = CounterMetricFamily(
            "pagoda:request_slo_refused",
            "Requests refused (429) as unable to meet their latency targets, by the target.",
            labels=["model_name", "reason"],
        )
        refused.add_metric([self.model_name, "ttft"], float(stats.num_slo_refused_ttft))
        refused.add_metric([self.model_name, "tpot"], float(stats.num_slo_refused_tpot))
        yield refused
        kv = stats.kv_cache
        info = GaugeMetricFamily(
            "pagoda:cache_config_info",
            "The KV cache's configuration (always 1; the labels carry it).",
            labels=["model_name", "kv_cache_dtype", "block_size", "num_blocks", "capacity_tokens"],
        )
        labels = [kv.dtype, str(kv.block_size), str(kv.num_blocks_total), str(kv.capacity_tokens)]
        info.add_metric([self.model_name, *labels], 1.0)
        yield info

    def _spec_decoding(self, spec: SpecDecodingStats) -> Iterator[Metric]:
        for name, doc, value in (
            ("num_drafts", "Request-steps that verified drafts.", spec.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
            (
                "num_emitted_tokens",
                "Tokens emitted by verifying steps (accepted drafts plus one each).",
                spec.num_emitted_tokens,
            ),
        ):
            family = CounterMetricFamily(f"pagoda:spec_decode_{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family
        for name, doc, values in (
            ("drafted", "Draft tokens proposed at each position.", spec.num_drafted_per_pos),
            ("accepted", "Draft tokens accepted at each position.", spec.num_accepted_per_pos),
        ):
            family = CounterMetricFamily(
                f"pagoda:spec_decode_num_{name}_tokens_per_pos",
                doc,
                labels=["model_name", "position"],
            )
            for position, value in enumerate(values):
                family.add_metric([self.model_name, str(position)], float(value))
            yield family

    def _tier(self, kv: KVCacheStats) -> Iterator[Metric]:
        tier = kv.tier
        for kind, name, doc, value in (
            (GaugeMetricFamily, "blocks", "KV blocks the disk tier holds.", tier.stored_blocks),
            (GaugeMetricFamily, "bytes", "Bytes the disk tier's files take.", tier.stored_bytes),
            (
                CounterMetricFamily,
                "hit_tokens",
                "Prompt tokens loaded from the disk tier (of prefix_cache_hits).",
                kv.tier_hit_tokens,
            ),
            (
                CounterMetricFamily,
                "queries",
                "KV blocks looked up in the disk tier (after missing in memory).",
                tier.queries,
            ),
            (CounterMetricFamily, "hits", "KV blocks found in the disk tier.", tier.hits),
            (
                CounterMetricFamily,
                "ram_hits",
                "Of kv_tier_hits, blocks found in its host-RAM part (no file read).",
                tier.ram_hits,
            ),
            (
                CounterMetricFamily,
                "written_bytes",
                "Bytes written to the disk tier.",
                tier.bytes_written,
            ),
            (CounterMetricFamily, "read_bytes", "Bytes read from the disk tier.", tier.bytes_read),
            (
                CounterMetricFamily,
                "load_seconds",
                "Time spent reading and checking the disk tier's files.",
                tier.load_seconds,
            ),
            (
                CounterMetricFamily,
                "removed_blocks",
                "Disk tier files removed: damaged or foreign, or over the byte budget.",
                tier.blocks_removed,
            ),
        ):
            family = kind(f"pagoda:kv_tier_{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family

    def _lora(self, lora: LoRAStats) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "pagoda:lora_requests_info",
            "LoRA adapters of running and waiting requests (vLLM's; the value is the time).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running, waiting = ",".join(lora.running_adapters), ",".join(lora.waiting_adapters)
        info.add_metric([str(lora.max_loras), running, waiting], time.time())
        yield info
        resident = GaugeMetricFamily(
            "pagoda:lora_adapters_resident",
            "LoRA adapters held in the model's slots.",
            labels=["model_name"],
        )
        resident.add_metric([self.model_name], float(lora.num_resident))
        yield resident

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are fixed; nothing to check at registration


class EngineMetrics:
    """The metrics of one engine, in their own registry; `render()` is the /metrics body."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        stats_fn: Callable[[], SchedulerStats] | None = None,
        lora_enabled: bool = False,
    ) -> None:
        """With `lora_enabled`, finished requests are counted by adapter too (a
        `lora_name` label, "" for the base model)."""
        self.model_name = model_name
        self.lora_enabled = lora_enabled
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        kw = {"labelnames": labels, "registry": self.registry}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, **kw).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, buckets=buckets, **kw).labels(model_name)

        self.prompt_tokens = counter("pagoda:prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("pagoda:generation_tokens", "Generated tokens.")
        self._success = Counter(
            "pagoda:request_success",
            "Finished requests, by finish reason" + (" and LoRA adapter." if lora_enabled else "."),
            labelnames=["model_name", "finished_reason"] + (["lora_name"] if lora_enabled else []),
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort", "error"):  # present (at 0) from the start
            self._success.labels(model_name, reason, *([""] if lora_enabled else []))
        # Goodput: finished requests with latency targets that met them, or which they
        # missed (the first: ttft, then tpot). Aborted and failed ones count in neither.
        self.slo_met = counter(
            "pagoda:request_slo_met", "Finished requests that met their latency targets."
        )
        self._slo_missed = Counter(
            "pagoda:request_slo_missed",
            "Finished requests that missed a latency target, by the first missed.",
            labelnames=["model_name", "reason"],
            registry=self.registry,
        )
        for reason in ("ttft", "tpot"):
            self._slo_missed.labels(model_name, reason)
        self.ttft = histogram(
            "pagoda:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "pagoda:inter_token_latency_seconds", "Time between output steps.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "pagoda:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "pagoda:request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "pagoda:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per finished request.",
            ITL_BUCKETS,
        )
        buckets = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "pagoda:request_prompt_tokens", "Prompt length of finished requests.", buckets
        )
        self.request_generation_tokens = histogram(
            "pagoda:request_generation_tokens", "Generated tokens of finished requests.", buckets
        )
        if stats_fn is not None:
            self.registry.register(_EngineStatsCollector(model_name, stats_fn))

    def record(self, stats: IterationStats) -> None:
        """One step's (or abort's) request timelines, from the engine thread."""
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.itl.observe(value)
        for value in stats.queue_times:
            self.queue_time.observe(value)
        for r in stats.finished_requests:
            lora = [r.lora_name] if self.lora_enabled else []
            self._success.labels(self.model_name, r.finish_reason, *lora).inc()
            self.request_prompt_tokens.observe(r.num_prompt_tokens)
            self.request_generation_tokens.observe(r.num_generation_tokens)
            self.e2e.observe(r.e2e_latency)
            if r.time_per_output_token is not None:
                self.tpot.observe(r.time_per_output_token)
            if r.slo is not None and r.finish_reason in ("stop", "length"):
                missed = r.slo_missed
                if missed is None:
                    self.slo_met.inc()
                else:
                    self._slo_missed.labels(self.model_name, missed).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)
