"""Request traces, two ways, both stat loggers fed on the engine thread:

- `RequestLogger` (`pagoda serve --request-log PATH`): one JSON line per
  finished request, written whole and flushed, so `tail -f | jq` and log
  shippers see each line at once;
- `RequestTracer` (`--otlp-traces-endpoint URL`, vLLM's flag): one
  OpenTelemetry span per finished request, exported over OTLP/HTTP by the SDK's
  batch processor (its own thread; the engine only hands spans over). A request
  that came with a W3C `traceparent` header gets its span as that trace's
  child, so a gateway's trace shows the time spent in pagoda.

Both carry a request's timeline (arrival, queued in the engine, first
scheduled, first token, finished), its token counts, the prompt tokens the
prefix cache served, and its preemptions.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TextIO

from pagoda.core.stats import FinishedRequestStats, IterationStats


class _UnixClock:
    """time.monotonic() -> Unix seconds (the two clocks drift apart far slower than a
    request lasts)."""

    def __init__(self) -> None:
        self.offset = time.time() - time.monotonic()

    def __call__(self, t: float | None) -> float | None:
        return None if t is None else t + self.offset


def _between(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 6)


class RequestLogger:
    def __init__(self, path: str, model_name: str) -> None:
        """`path`: a file to append to, or "-" for stderr."""
        self.model_name = model_name
        self._owns = path != "-"
        # Open for the server's life, closed by close().
        self._file: TextIO = (
            open(path, "a", encoding="utf-8")  # noqa: SIM115
            if self._owns
            else sys.stderr
        )
        self._lock = threading.Lock()  # close() may come from another thread
        self._unix = _UnixClock()

    def record(self, stats: IterationStats) -> None:
        if not stats.finished_requests:
            return
        lines = "".join(json.dumps(self.trace(r)) + "\n" for r in stats.finished_requests)
        with self._lock:
            if not self._file.closed:
                self._file.write(lines)
                self._file.flush()

    def trace(self, r: FinishedRequestStats) -> dict:
        m = r.timeline

        def unix(t: float | None) -> float | None:
            return None if t is None else round(self._unix(t), 6)

        return {
            "event": "request_finished",
            "request_id": r.request_id,
            "model": self.model_name,
            "lora_name": r.lora_name or None,
            "finish_reason": r.finish_reason,
            "arrival_time": unix(m.arrival_time),
            "queued_time": unix(m.queued_time),
            "first_scheduled_time": unix(m.first_scheduled_time),
            "first_token_time": unix(m.first_token_time),
            "finished_time": unix(m.finished_time),
            "queue_s": _between(m.arrival_time, m.first_scheduled_time),
            "ttft_s": _between(m.arrival_time, m.first_token_time),
            "e2e_s": _between(m.arrival_time, m.finished_time),
            "tpot_s": None
            if r.time_per_output_token is None
            else round(r.time_per_output_token, 6),
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_cached_tokens": r.num_cached_tokens,
            "num_generation_tokens": r.num_generation_tokens,
            "num_preemptions": r.num_preemptions,
        }

    def close(self) -> None:
        with self._lock:
            if self._owns and not self._file.closed:
                self._file.close()


class RequestTracer:
    """One span per finished request, `llm_request`, with vLLM's `gen_ai.*` attributes
    and events at the request's milestones."""

    def __init__(self, endpoint: str, model_name: str, service_name: str = "pagoda") -> None:
        """`endpoint`: an OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise ValueError(
                "--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                "pip install 'pagoda[otel]'."
            ) from e
        self.model_name = model_name
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("pagoda")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._unix = _UnixClock()

    def _ns(self, t: float) -> int:
        return int(self._unix(t) * 1e9)

    def record(self, stats: IterationStats) -> None:
        for r in stats.finished_requests:
            self._export(r)

    def _export(self, r: FinishedRequestStats) -> None:
        m = r.timeline
        parent = self._propagator.extract(r.trace_headers) if r.trace_headers else None
        span = self._tracer.start_span(
            "llm_request", context=parent, kind=self._kind, start_time=self._ns(m.arrival_time)
        )
        attributes = {
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.id": r.request_id,
            "gen_ai.response.finish_reasons": [r.finish_reason],
            "gen_ai.usage.prompt_tokens": r.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": r.num_generation_tokens,
            "gen_ai.latency.e2e": r.e2e_latency,
            "pagoda.num_cached_tokens": r.num_cached_tokens,
            "pagoda.num_preemptions": r.num_preemptions,
        }
        if r.lora_name:
            attributes["pagoda.lora_name"] = r.lora_name
        queue = _between(m.arrival_time, m.first_scheduled_time)
        if queue is not None:
            attributes["gen_ai.latency.time_in_queue"] = queue
        ttft = _between(m.arrival_time, m.first_token_time)
        if ttft is not None:
            attributes["gen_ai.latency.time_to_first_token"] = ttft
        if r.time_per_output_token is not None:
            attributes["gen_ai.latency.time_per_output_token"] = r.time_per_output_token
        span.set_attributes(attributes)
        for name, t in (
            ("queued", m.queued_time),
            ("first_scheduled", m.first_scheduled_time),
            ("first_token", m.first_token_time),
        ):
            if t is not None:
                span.add_event(name, timestamp=self._ns(t))
        span.end(end_time=self._ns(m.finished_time))

    def close(self) -> None:
        """Export what is pending and stop the exporter's thread."""
        self._provider.shutdown()
