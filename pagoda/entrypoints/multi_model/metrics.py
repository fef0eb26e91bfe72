"""The many-model server's own Prometheus metrics (its `/metrics`), per model."""

from __future__ import annotations

import prometheus_client as prom

_LOAD_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class HostMetrics:
    def __init__(self, models) -> None:
        """`models`: the HostedModels, whose state and in-flight counts are read at
        each scrape."""
        self.registry = registry = prom.CollectorRegistry()
        self.loaded_gauge = prom.Gauge(
            "pagoda_models:loaded", "1 while the model's server is up", ["model"],
            registry=registry,
        )  # fmt: skip
        self.in_flight = prom.Gauge(
            "pagoda_models:in_flight", "Requests in flight", ["model"], registry=registry
        )
        self.requests = prom.Counter(
            "pagoda_models:requests", "Requests relayed to the model", ["model"],
            registry=registry,
        )  # fmt: skip
        self.loads = prom.Counter(
            "pagoda_models:loads", "Times the model was loaded", ["model"], registry=registry
        )
        self.load_seconds = prom.Histogram(
            "pagoda_models:load_seconds", "From the load's start to its server answering",
            ["model"], buckets=_LOAD_BUCKETS, registry=registry,
        )  # fmt: skip
        self.unloads = prom.Counter(
            "pagoda_models:unloads",
            "Times the model was unloaded, by reason: room (another model needed it), idle "
            "(keep-alive), request (/models/unload), exited (its server died)",
            ["model", "reason"],
            registry=registry,
        )
        for m in models:
            self.loaded_gauge.labels(m.name).set_function(lambda m=m: float(m.state == "loaded"))
            self.in_flight.labels(m.name).set_function(lambda m=m: m.in_flight)

    def loaded(self, model: str, seconds: float) -> None:
        self.loads.labels(model).inc()
        self.load_seconds.labels(model).observe(seconds)

    def unloaded(self, model: str, reason: str) -> None:
        self.unloads.labels(model, reason).inc()

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)
