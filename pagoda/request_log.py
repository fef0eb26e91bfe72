"""Request traces: one JSON line per finished request (`pagoda serve --request-log`).

A stat logger: the engine hands it each step's `IterationStats` on the engine
thread, and it writes a line for each request that finished in that step, with
its timeline as Unix times (arrival, queued in the engine, first scheduled,
first token, finished), the durations between them, its token counts, the
prompt tokens the prefix cache served and its preemptions. Lines are written
whole and flushed, so `tail -f | jq` and log shippers see each one at once.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TextIO

from pagoda.core.stats import FinishedRequestStats, IterationStats


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
        # time.monotonic() -> Unix time; the two clocks drift apart far slower than a request.
        self._to_unix = time.time() - time.monotonic()

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
            return None if t is None else round(t + self._to_unix, 6)

        def between(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 6)

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
            "queue_s": between(m.arrival_time, m.first_scheduled_time),
            "ttft_s": between(m.arrival_time, m.first_token_time),
            "e2e_s": between(m.arrival_time, m.finished_time),
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
