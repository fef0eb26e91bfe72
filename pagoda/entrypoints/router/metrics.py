"""The router's own Prometheus metrics (its `/metrics`), per replica where it counts."""

from __future__ import annotations

import contextlib

import prometheus_client as prom


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        labels, registry = ["replica"], self.registry
        self.requests_total = prom.Counter(
            "pagoda_router:requests", "Requests routed (a retry counts again)", labels,
            registry=registry,
        )  # fmt: skip
        self.prompt_blocks = prom.Counter(
            "pagoda_router:prompt_blocks", "Full prompt blocks routed", labels, registry=registry
        )
        self.matched_blocks = prom.Counter(
            "pagoda_router:matched_blocks",
            "Prompt blocks routed to a replica already sent them (prefix hits, as the "
            "router sees them)",
            labels,
            registry=registry,
        )
        self.retries = prom.Counter(
            "pagoda_router:retries", "Requests sent again after a replica could not be reached",
            registry=registry,
        )  # fmt: skip
        self.healthy = prom.Gauge(
            "pagoda_router:replica_healthy", "1 while the replica takes requests", labels,
            registry=registry,
        )  # fmt: skip
        self.kv_event_batches = prom.Counter(
            "pagoda_router:kv_event_batches", "KV event batches applied (--kv-events)", labels,
            registry=registry,
        )  # fmt: skip
        self.in_flight = prom.Gauge(
            "pagoda_router:replica_in_flight", "Requests in flight", labels, registry=registry
        )
        self.replica_restarts = prom.Counter(
            "pagoda_router:replica_restarts",
            "Replicas of `pagoda serve --data-parallel-size` started again after they exited",
            labels,
            registry=registry,
        )
        self._per_replica = (
            self.requests_total,
            self.prompt_blocks,
            self.matched_blocks,
            self.healthy,
            self.in_flight,
            self.kv_event_batches,
            self.replica_restarts,
        )

    def forget(self, url: str) -> None:
        """A replica no longer among the router's: its series go."""
        for metric in self._per_replica:
            with contextlib.suppress(KeyError):  # never routed to: no child
                metric.remove(url)

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)
