"""Serving to a deadline: what a step costs, each request's slack, and load shedding.

A request may carry latency targets (`Request.slo`: time to first token, time per
output token; the server's defaults filled in by the front door). Three uses of one
estimate, the engine's measured step cost (`StepCost`, owned here):

    slack      the waiting queue (`SlackQueue`, core/request_queue.py) runs the
               request with the least slack first: the latest time it may start
               and still meet its TTFT target, `latest_start`
    admission  a new request whose TTFT target cannot be met behind the work queued
               ahead of it, or whose joining would slow the running requests' tokens
               (a decode step and the recent prefill stall) past a TPOT target, is
               refused at once (`DeadlineUnmeetableError`, with when it could be
               met) instead of queueing to miss it
    refusals   counted by the target they failed, for the metrics

A request without targets is never refused. Until a step has been measured, and while
the engine is idle, a request is refused only if it is late already (it waited at the
door past its TTFT target): there is nothing to estimate with, or no work to protect,
and a wrong estimate must not lock the engine out of the steps that would correct it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from pagoda.config import SchedulerConfig
from pagoda.core.request_queue import RequestQueue
from pagoda.core.sched_output import SchedulerOutput
from pagoda.core.step_shape import StepShape
from pagoda.errors import DeadlineUnmeetableError
from pagoda.request import Request


class StepCost:
    """Seconds a step takes, learned online from the steps the engine measures:

        seconds = base + per_decode_row * decode rows + per_prefill_token * prefill tokens

    base and per_decode_row: a least-squares line (neither below 0) through the
    decode-only steps, each older one weighted down by `decay` (an exponential moving
    average of the normal equations); a CPU decode step is mostly weight reads, a fixed
    cost that a price per row alone would multiply. A ridge holds per_decode_row at 0
    until steps of sizes different enough tell it apart from the base: a few noisy
    steps of one or two rows would otherwise draw a line of any slope.
    per_prefill_token: a moving average over the steps that prefill, of what they took
    beyond their decode part, per prefill token. Each moves only on steps that tell it
    something, so a quiet spell of decodes does not wash out what prefill costs.

    prefill_stall: a moving average, over the steps that decode, of their prefill part:
    what a decoding request waits for other requests' prompts at each of its tokens. It
    is the load admission itself adds (each admitted prompt stalls the running ones), so
    a time per output token estimated without it would be met only by decode-only steps."""

    RIDGE = 16.0  # in (decode rows)^2: a spread of 4 rows in one step's worth
    # Prompts come in lumps (one step carries a whole prompt): the stall is averaged
    # over about a hundred steps, a few arrivals, not the twenty of the costs.
    STALL_DECAY = 0.99

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        # Decayed sums over decode-only steps: n, rows, rows^2, seconds, rows * seconds.
        self._n = self._r = self._rr = self._s = self._rs = 0.0
        self.base = self.per_decode_row = self.per_prefill_token = self.prefill_stall = 0.0
        self.num_steps = self._num_prefill_steps = 0

    def record(self, num_prefill_tokens: int, num_decode_rows: int, seconds: float) -> None:
        """One step's measured wall time and what it computed."""
        self.num_steps += 1
        if num_decode_rows:
            stall = (
                max(seconds - self.decode_seconds(num_decode_rows), 0.0)
                if num_prefill_tokens
                else 0.0
            )
            self.prefill_stall += (1 - self.STALL_DECAY) * (stall - self.prefill_stall)
        if num_prefill_tokens:
            sample = (seconds - self.decode_seconds(num_decode_rows)) / num_prefill_tokens
            # The mean of the first samples, then a moving average: a slow first step
            # (caches cold, kernels chosen) weighs no more than its share.
            self._num_prefill_steps += 1
            weight = max(1 - self.decay, 1 / self._num_prefill_steps)
            self.per_prefill_token += weight * (max(sample, 0.0) - self.per_prefill_token)
            return
        d, r = self.decay, float(num_decode_rows)
        self._n, self._r, self._rr = d * self._n + 1, d * self._r + r, d * self._rr + r * r
        self._s, self._rs = d * self._s + seconds, d * self._rs + r * seconds
        rr = self._rr + self.RIDGE
        det = self._n * rr - self._r * self._r  # > 0: the ridge keeps it so
        per_row = (self._n * self._rs - self._r * self._s) / det
        base = (self._s - per_row * self._r) / self._n
        if base < 0:  # the best line through 0
            base, per_row = 0.0, self._rs / rr
        if per_row < 0:  # the best flat line
            base, per_row = self._s / self._n, 0.0
        self.base, self.per_decode_row = base, per_row

    def decode_seconds(self, num_decode_rows: int) -> float:
        """A step of `num_decode_rows` decode rows and no prefill."""
        return self.base + self.per_decode_row * num_decode_rows

    def token_seconds(self, num_decode_rows: int) -> float:
        """The time between a decoding request's tokens with `num_decode_rows` decoding:
        a decode step and the prefill stall the steps have had of late."""
        return self.decode_seconds(num_decode_rows) + self.prefill_stall

    def prefill_seconds(self, num_tokens: int, num_decode_rows: int, budget: int) -> float:
        """The steps that prefill `num_tokens` while `num_decode_rows` requests decode
        beside them, `budget` tokens a step: their decode parts and the tokens."""
        if num_tokens <= 0:
            return 0.0
        num_steps = math.ceil(num_tokens / max(budget - num_decode_rows, 1))
        return (
            num_steps * self.decode_seconds(num_decode_rows) + num_tokens * self.per_prefill_token
        )


def _remaining_prompt(requests: Iterable[Request]) -> int:
    return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in requests)


class Deadlines:
    """The step cost estimate, the slack it gives each request, admission by it, and
    the count of refusals (by the target that failed)."""

    # Admission wants the estimates, means, to fit a target with this much to spare: a
    # request's own times scatter around them (admitting up to the mean itself would
    # have about half the admitted miss; measured on SmolLM2, 2-core EPYC).
    MARGIN = 1.25

    def __init__(self, config: SchedulerConfig) -> None:
        self.cost = StepCost()
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.num_refused = {"ttft": 0, "tpot": 0}
        self.clock = time.monotonic  # requests' arrival times are on it (tests fake it)
        # With the server's targets on, the waiting queue's key (a SlackQueue); else None:
        # the policy's own order, exactly as without deadlines.
        slo_on = config.slo_ttft_ms is not None or config.slo_tpot_ms is not None
        self.slack: Callable[[Request], float] | None = self.latest_start if slo_on else None

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        """A step the engine ran (schedule to outputs) and its measured wall time."""
        if output.scheduled:
            shape = StepShape.of(output)
            self.cost.record(shape.prefill_tokens, shape.decode_rows, seconds)

    def latest_start(self, request: Request) -> float:
        """The latest time (time.monotonic()) `request` may start and still meet its TTFT
        target: its deadline less its own prefill's estimate. Without a target, its
        arrival: it is due at once, so later deadlines never starve it."""
        slo = request.slo
        if slo is None or slo.ttft_ms is None or request.num_output_tokens:
            return request.arrival_time  # (with output, its first token is behind it)
        num_tokens = request.num_tokens - request.num_computed_tokens
        prefill = self.cost.prefill_seconds(num_tokens, 0, self.max_num_batched_tokens)
        return request.arrival_time + slo.ttft_ms / 1000 - prefill

    def admit(
        self,
        request: Request,
        waiting: RequestQueue,
        running: list[Request],
        num_seqs: int = 1,
    ) -> None:
        """Refuse `request` (raise DeadlineUnmeetableError) if its targets cannot be met:
        its first token, behind the prompts queued ahead of it and the running ones
        still prefilling, after its TTFT deadline; or the time per token with every
        running and waiting sequence and its `num_seqs` decoding (a decode step and the
        recent prefill stall) over its own TPOT target or one of theirs; each estimate
        with a margin (MARGIN). Returns
        quietly otherwise (and always without targets). It does not ask whether those
        it would go before could still meet theirs."""
        slo = request.slo
        if slo is None:
            return
        cost = self.cost
        # Idle, or nothing measured yet: no estimate stands between it and its steps (a
        # wrong one must not lock the engine out of the steps that would correct it).
        idle = not (running or waiting) or not cost.num_steps
        if slo.ttft_ms is not None:
            num_tokens = _remaining_prompt([*running, *waiting.ahead_of(request), request])
            wait = cost.prefill_seconds(num_tokens, len(running), self.max_num_batched_tokens)
            wait = 0.0 if idle else wait
            late = self.clock() + self.MARGIN * wait - (request.arrival_time + slo.ttft_ms / 1000)
            if late > 0:
                self._refuse(
                    "ttft",
                    f"by the work queued ahead of it, its first token would come about "
                    f"{1000 * late:.0f} ms past its target of {slo.ttft_ms:g} ms",
                    late,
                )
        targets = [r.slo.tpot_ms for r in (request, *running, *waiting) if r.slo and r.slo.tpot_ms]
        if targets and not idle:
            num_rows = min(len(running) + len(waiting) + num_seqs, self.max_num_seqs)
            # (Nothing running: the stalls of the last busy spell are nobody's now.)
            step = cost.token_seconds(num_rows) if running else cost.decode_seconds(num_rows)
            if self.MARGIN * step * 1000 > min(targets):
                # It could be met once the first running request finishes (at best).
                left = min((_tokens_left(r) for r in running), default=0)
                self._refuse(
                    "tpot",
                    f"with {num_rows} sequences decoding, a token would take about "
                    f"{1000 * step:.0f} ms, over the target of {min(targets):g} ms",
                    left * cost.token_seconds(len(running)),
                )

    def _refuse(self, target: str, why: str, retry_after: float) -> None:
        self.num_refused[target] += 1
        param = f"slo_{target}_ms"
        raise DeadlineUnmeetableError(
            f"{param} cannot be met now: {why}; retry later.",
            param,
            max(1, math.ceil(retry_after)),
        )


def _tokens_left(request: Request) -> int:
    """Output tokens a running request may still make (its max_tokens; at least 1)."""
    max_tokens = request.sampling_params.max_tokens
    return max((max_tokens or 1) - request.num_output_tokens, 1)
