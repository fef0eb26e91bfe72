"""What arrives at a simulated fleet: requests (prompt token ids, output length,
arrival time), from a workload shape and an arrival process, or from a JSONL trace.

Shapes:
- `uniform`: prompts of `prompt_len` tokens (+-50%), none shared;
- `shared-prefix`: `num_prefixes` families of `prefix_len`-token prefixes (a system
  prompt, a document), each prompt its family's prefix and its own rest;
- `sessions`: multi-turn conversations over `num_prefixes` shared system prompts; a
  turn resends the conversation (its earlier turns' questions and answers) and asks
  anew, `think_s` after the previous turn's arrival.
Arrivals: `poisson` at `rate`; `gamma` (bursty: gaps' coefficient of variation
`burstiness`); `day` (a Poisson process whose rate follows a day: from 0.2x to 1.8x
`rate` and back over the run).
A trace line: {"time": s, "prompt_tokens": n, "output_tokens": m} with optional
"prefix_id" and "prefix_tokens" (requests of one prefix id share that many leading
tokens) and "session" (its turns share their history's tokens as well).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("uniform", "shared-prefix", "sessions")
ARRIVALS = ("poisson", "gamma", "day")
VOCAB = 32000
QUESTION_TOKENS = 64


@dataclass
class SimRequest:
    arrival: float  # seconds from the start
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    workload: str = "shared-prefix"
    num_requests: int = 1000
    rate: float = 10.0  # requests per second (sessions: turns per second)
    arrivals: str = "poisson"
    burstiness: float = 4.0
    prompt_len: int = 512
    output_len: int = 128
    num_prefixes: int = 16
    prefix_len: int = 448
    turns: int = 4
    think_s: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}.")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {ARRIVALS}, got {self.arrivals!r}.")
        if self.num_requests < 1 or not self.rate > 0:
            raise ValueError("num_requests must be >= 1 and rate > 0.")
        if self.prefix_len >= self.prompt_len and self.workload == "shared-prefix":
            raise ValueError("prefix_len must be shorter than prompt_len.")


def arrival_times(n: int, rate: float, kind: str, rng, burstiness: float = 4.0) -> np.ndarray:
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif kind == "gamma":  # coefficient of variation `burstiness`: shape 1/cv^2
        shape = 1.0 / burstiness**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    else:  # day: thinning a Poisson process of the peak rate
        span = n / rate
        times, t = [], 0.0
        peak = 1.8 * rate
        while len(times) < n:
            t += rng.exponential(1.0 / peak)
            now_rate = rate * (1.0 - 0.8 * math.cos(2 * math.pi * t / span))
            if rng.random() * peak < now_rate:
                times.append(t)
        return np.array(times)
    return np.cumsum(gaps) - gaps[0]


def make_requests(spec: WorkloadSpec) -> list[SimRequest]:
    rng = np.random.default_rng(spec.seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(100, VOCAB, n).tolist()

    n = spec.num_requests
    if spec.workload == "sessions":
        return _sessions(spec, rng, tokens)
    times = arrival_times(n, spec.rate, spec.arrivals, rng, spec.burstiness)
    if spec.workload == "uniform":
        lengths = rng.integers(spec.prompt_len // 2, spec.prompt_len * 3 // 2 + 1, n)
        return [SimRequest(float(t), tokens(int(m)), spec.output_len)
                for t, m in zip(times, lengths, strict=True)]  # fmt: skip
    prefixes = [tokens(spec.prefix_len) for _ in range(spec.num_prefixes)]
    families = rng.integers(0, spec.num_prefixes, n)
    rest = spec.prompt_len - spec.prefix_len
    return [SimRequest(float(t), prefixes[f] + tokens(rest), spec.output_len)
            for t, f in zip(times, families, strict=True)]  # fmt: skip


def _sessions(spec: WorkloadSpec, rng, tokens) -> list[SimRequest]:
    num_sessions = -(-spec.num_requests // spec.turns)  # the last ones cut short
    starts = arrival_times(num_sessions, spec.rate / spec.turns, spec.arrivals, rng,
                           spec.burstiness)  # fmt: skip
    systems = [tokens(spec.prefix_len) for _ in range(spec.num_prefixes)]
    reqs = []
    for start, system in zip(starts, rng.integers(0, spec.num_prefixes, num_sessions),
                             strict=True):  # fmt: skip
        history = list(systems[system])
        for turn in range(spec.turns):
            history += tokens(QUESTION_TOKENS)
            reqs.append(SimRequest(float(start) + turn * spec.think_s, list(history),
                                   spec.output_len))  # fmt: skip
            history += tokens(spec.output_len)  # the answer, as the next turn resends it
    reqs.sort(key=lambda r: r.arrival)
    return reqs[: spec.num_requests]


def load_trace(path: str, seed: int = 0) -> list[SimRequest]:
    """Requests from a JSONL trace (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    prefixes: dict = {}
    sessions: dict = {}
    reqs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                time, n, m = (
                    float(row["time"]),
                    int(row["prompt_tokens"]),
                    int(row["output_tokens"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{number}: expected time, prompt_tokens, output_tokens ({e})"
                ) from e
            prompt: list[int] = []
            if "session" in row:
                prompt = list(sessions.get(row["session"], []))
            elif "prefix_id" in row:
                length = int(row.get("prefix_tokens", n // 2))
                key = (row["prefix_id"], length)
                if key not in prefixes:
                    prefixes[key] = rng.integers(100, VOCAB, length).tolist()
                prompt = list(prefixes[key])
            prompt = prompt[:n] + rng.integers(100, VOCAB, max(0, n - len(prompt))).tolist()
            if "session" in row:
                sessions[row["session"]] = prompt + rng.integers(100, VOCAB, m).tolist()
            reqs.append(SimRequest(time, prompt, m))
    reqs.sort(key=lambda r: r.arrival)
    return reqs
