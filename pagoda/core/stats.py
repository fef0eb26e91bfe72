"""Typed snapshots of engine state, each built by the part that owns the numbers.

`KVCacheStats` comes from the `KVCacheManager`, `SchedulerStats` from the
`Scheduler` (with the KV snapshot inside); `LLMEngine.get_stats()` returns
the latter. Counters (`num_*_tokens`, preemptions, prefix-cache queries and
hits) are cumulative since the engine started; the rest are current values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks_total: int
    num_blocks_used: int
    num_requests_swapped: int  # requests whose blocks sit in the host pool
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached

    @property
    def usage_perc(self) -> float:
        return 100.0 * self.num_blocks_used / self.num_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


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

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap
