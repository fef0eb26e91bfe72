"""Serving metrics as vLLM's benchmarks define them, from per-request timelines."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTimeline:
    """One request's life, in seconds on one clock."""

    arrival: float
    token_times: list[float] = field(default_factory=list)  # when each output token arrived
    prompt_len: int = 0
    output_len: int = 0  # tokens the request asked for (counted as useful)
    success: bool = True
    refused: bool = False  # not successful: the server refused it at once (a 429)
    # Output tokens received, where one timestamp can stand for several (an HTTP
    # stream's chunk); None: one timestamp per token.
    num_tokens: int | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None for one-token outputs."""
        n = len(self.token_times) if self.num_tokens is None else self.num_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []


def summarize(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, median, p90, p99 (in ms by default); zeros when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def compute_metrics(
    timelines: list[RequestTimeline],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, object]:
    """Throughputs, latency summaries (ms) and goodput over successful requests, and
    `per_request` lists (TTFT, TPOT, E2EL in ms; None for a failed request) in the
    order of `timelines`. Every request is completed, refused (a 429: counted, never
    good) or failed; `good` counts those that met the SLOs given."""
    ok = [t for t in timelines if t.success and t.token_times]
    output_tokens = sum(t.output_len for t in ok)
    prompt_tokens = sum(t.prompt_len for t in ok)
    tpots = [t.tpot for t in ok if t.tpot is not None]
    good = 0
    for t in ok:
        meets_ttft = slo_ttft_ms is None or t.ttft * 1000 <= slo_ttft_ms
        meets_tpot = slo_tpot_ms is None or t.tpot is None or t.tpot * 1000 <= slo_tpot_ms
        good += meets_ttft and meets_tpot
    num_refused = sum(t.refused for t in timelines)
    return {
        "completed": len(ok),
        "refused": num_refused,
        "failed": len(timelines) - len(ok) - num_refused,
        "good": good,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration if duration else 0.0,
        "goodput": good / duration if duration else 0.0,
        "ttft_ms": summarize([t.ttft for t in ok]),
        "tpot_ms": summarize(tpots),
        "itl_ms": summarize([x for t in ok for x in t.itls]),
        "e2el_ms": summarize([t.e2el for t in ok]),
        "per_request": _per_request(timelines),
    }


def _per_request(timelines: list[RequestTimeline]) -> dict[str, list]:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000 * x, 3)

    done = [t.success and bool(t.token_times) for t in timelines]
    return {
        "ttft_ms": [ms(t.ttft) if d else None for t, d in zip(timelines, done, strict=True)],
        "tpot_ms": [ms(t.tpot) if d else None for t, d in zip(timelines, done, strict=True)],
        "e2el_ms": [ms(t.e2el) if d else None for t, d in zip(timelines, done, strict=True)],
        "output_len": [t.output_len if d else 0 for t, d in zip(timelines, done, strict=True)],
    }
