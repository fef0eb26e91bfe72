"""`AsyncEngine`: the synchronous `LLMEngine` behind an asyncio interface.

The engine is not thread-safe, so exactly one thread touches it: a background
"engine thread" that applies queued adds and aborts between steps, steps
while any request is unfinished, and blocks on a condition variable when
idle (no busy polling). Callers on any asyncio loop talk to it through a
lock-protected list of operations; outputs come back to each request's
`RequestStream` through `loop.call_soon_threadsafe`, one callback per loop
per step.

    caller (event loop)            engine thread
    add_request ── ops ──────────▶ engine.add_request ─┐
    abort       ── ops ──────────▶ engine.abort_request │ between steps
                                   engine.step() ◀──────┘
    RequestStream ◀── call_soon_threadsafe ── outputs, metrics

Per-request latency metrics (TTFT, inter-token latency, end-to-end, queue
time) are measured here, in the engine thread, as outputs leave the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagoda.config import EngineArgs
from pagoda.core.stats import SchedulerStats
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.processor import PromptType
from pagoda.metrics import EngineMetrics
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are queued than `max_queue_len` allows; retry after `retry_after` s."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineNotAcceptingError(RuntimeError):
    """The engine is shutting down, or has died (`__cause__` says why)."""


@dataclass
class _Timing:
    """Engine-thread bookkeeping for one request's latency metrics."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Each item is a cumulative `RequestOutput` (every completion's text, token
    ids and logprobs so far), so a reader that falls behind gets only the
    newest one: outputs it missed are contained in it, and memory stays
    bounded however slow the reader. The last item has `finished=True`
    (finish_reason "abort" when it was aborted). If the engine fails, the
    iterator raises `EngineNotAcceptingError`. Only the owning loop reads it.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def _put(self, item: RequestOutput | BaseException) -> None:  # on self.loop
        if not isinstance(self._latest, BaseException):  # an error is never replaced
            self._latest = item
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncEngine:
    """Runs an `LLMEngine` in a background thread; thread-safe, usable from any loop.

    `max_queue_len` bounds the requests accepted but not yet running; past it
    `add_request` raises `QueueFullError`.
    """

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        model_name: str | None = None,
        max_queue_len: int | None = None,
    ) -> None:
        """`engine`: an engine, or a function that builds one. A function runs in the
        engine thread, so that thread is the only one that ever runs torch: a second
        thread's OpenMP pool halves libgomp's spin-wait on 2 cores (measured: a B=1
        decode step 19 -> 28 ms when the engine is built on another thread)."""
        if max_queue_len is not None and max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}.")
        self.max_queue_len = max_queue_len
        self._cond = threading.Condition()
        self._ops: list[tuple] = []  # guarded by _cond
        self._num_unfinished = 0  # accepted and not finished; guarded by _cond
        # Adds not yet reflected in _stats; guarded by _cond, as is _stats itself.
        self._num_unseen_adds = 0
        self._accepting = True
        self._stopping = False
        self._error: BaseException | None = None
        self.num_steps = 0
        # Engine-thread state.
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._ids = itertools.count()
        built = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(engine, built), name="pagoda-engine", daemon=True
        )
        self._thread.start()
        built.wait()
        if self._error is not None:  # building the engine failed: the caller's error
            raise self._error
        self.model_name = model_name or self.engine.model_config.model
        self._stats: SchedulerStats = self._read_stats()
        self.metrics = EngineMetrics(self.model_name, self.engine.max_model_len, self.get_stats)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncEngine:
        return cls(lambda: LLMEngine.from_engine_args(engine_args), **kwargs)

    # ---- facts about the engine (read-only, safe from any thread) -------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine thread, if any."""
        return self._error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def get_stats(self) -> SchedulerStats:
        """The engine's stats as of its last step (see `LLMEngine.get_stats`)."""
        return self._stats

    def num_queued(self) -> int:
        """Sequences waiting to run: the engine's waiting count as of its last step,
        plus requests added since (a request with n > 1 waits as n sequences
        once the engine has it)."""
        with self._cond:
            return self._stats.num_requests_waiting + self._num_unseen_adds

    # ---- requests -------------------------------------------------------------

    def check_capacity(self, num_new: int = 1) -> None:
        """Raise if `num_new` more requests cannot be accepted now."""
        if self._error is not None:
            raise EngineNotAcceptingError("the engine has stopped after an error.") from self._error
        if not self._accepting:
            raise EngineNotAcceptingError("the server is shutting down.")
        if self.max_queue_len is not None and self.num_queued() + num_new > self.max_queue_len:
            raise QueueFullError(
                f"the request queue is full ({self.max_queue_len} waiting); retry later."
            )

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises what `LLMEngine.add_request` raises (ValueError naming the field),
        `QueueFullError`, or `EngineNotAcceptingError`. Cancelling the caller
        aborts the request.
        """
        self.check_capacity(1)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        accepted = loop.create_future()
        op = ("add", request_id, prompt, params, priority, stream, accepted, time.monotonic())
        with self._cond:
            self._num_unfinished += 1
            self._num_unseen_adds += 1
            self._ops.append(op)
            self._cond.notify()
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs until it finishes.

        Closing or cancelling the iterator early (a client that went away)
        aborts the request in the engine, which frees its blocks.
        """
        if request_id is None:
            request_id = f"async-{next(self._ids)}"
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (thread-safe, returns at once); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._cond:
            self._ops.append(("abort", ids))
            self._cond.notify()

    def abort_all(self) -> None:
        """Abort every unfinished request; each stream ends with finish_reason "abort"."""
        with self._cond:
            self._ops.append(("abort_all",))
            self._cond.notify()

    def stop_accepting(self) -> None:
        """Refuse new requests (EngineNotAcceptingError); running ones go on."""
        self._accepting = False

    def shutdown(self, abort: bool = True, timeout: float | None = None) -> None:
        """Stop the engine thread: abort what is unfinished (or, with abort=False,
        finish it first), then join. Idempotent."""
        self._accepting = False
        with self._cond:
            if abort:
                self._ops.append(("abort_all",))
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is unfinished (for tests and drains)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                idle = self._num_unfinished == 0 and not self._ops
            if idle and self._stats.num_requests_running == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not become idle in time.")
            await asyncio.sleep(0.01)

    # ---- the engine thread -----------------------------------------------------

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: threading.Event) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:
            self._error = e
            return
        finally:
            built.set()
        try:
            self._loop()
        except BaseException as e:  # a bug or an OOM: fail every request, loudly
            logger.exception("pagoda engine thread died")
            self._error = e
            self._fail_all(e)

    def _loop(self) -> None:
        engine = self.engine
        busy = False
        while True:
            with self._cond:
                while not self._ops and not busy and not self._stopping:
                    self._cond.wait()
                ops, self._ops = self._ops, []
                stopping = self._stopping
            sends: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any, Any]]] = {}
            for op in ops:
                self._apply(op, sends)
            if engine.has_unfinished_requests():
                step_start = time.monotonic()
                outputs = engine.step()
                self.num_steps += 1
                now = time.monotonic()
                for output in outputs:
                    self._record(output, now, step_start)
                    self._send_output(output, sends)
            busy = engine.has_unfinished_requests()
            stats = self._read_stats()
            with self._cond:
                self._stats = stats
                self._num_unseen_adds -= sum(op[0] == "add" for op in ops)
            _post(sends)
            if stopping and not busy:
                with self._cond:
                    if not self._ops:
                        return

    def _apply(self, op: tuple, sends: dict) -> None:
        kind = op[0]
        if kind == "add":
            _, request_id, prompt, params, priority, stream, accepted, arrival = op
            error = None
            try:
                self.engine.add_request(request_id, prompt, params, priority, arrival)
            except Exception as e:  # bad input: the caller's error, not the engine's
                error = e
                with self._cond:
                    self._num_unfinished -= 1
            else:
                self._streams[request_id] = stream
                self._timings[request_id] = _Timing(arrival)
            sends.setdefault(stream.loop, []).append((_resolve, accepted, error))
        elif kind in ("abort", "abort_all"):
            ids = list(self._streams) if kind == "abort_all" else op[1]
            now = time.monotonic()
            for output in self.engine.abort_request(ids):
                self._record(output, now, now)
                self._send_output(output, sends)

    def _send_output(self, output: RequestOutput, sends: dict) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
            with self._cond:
                self._num_unfinished -= 1
        sends.setdefault(stream.loop, []).append((RequestStream._put, stream, output))

    def _record(self, output: RequestOutput, now: float, step_start: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        m = self.metrics
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        num_new = num_tokens - timing.num_generation_tokens
        if num_new > 0:
            if timing.first_token_time is None:
                timing.first_token_time = now
                m.ttft.observe(now - timing.arrival_time)
                # The step that made the first token started no earlier than the
                # request was first scheduled (equal unless its prefill was chunked).
                scheduled = output.metrics.get("first_scheduled_time", step_start)
                m.queue_time.observe(max(0.0, scheduled - timing.arrival_time))
                m.prompt_tokens.inc(len(output.prompt_token_ids))
            else:
                m.itl.observe(now - timing.last_token_time)
            timing.last_token_time = now
            timing.num_generation_tokens = num_tokens
            m.generation_tokens.inc(num_new)
        if output.finished:
            del self._timings[output.request_id]
            reason = output.outputs[0].finish_reason if output.outputs else "abort"
            m.observe_finished(
                reason, len(output.prompt_token_ids), num_tokens, now - timing.arrival_time
            )

    def _fail_all(self, error: BaseException) -> None:
        wrapped = EngineNotAcceptingError(f"the engine stopped: {error!r}")
        wrapped.__cause__ = error
        sends: dict = {}
        with self._cond:
            ops, self._ops = self._ops, []
        for op in ops:
            if op[0] == "add":
                sends.setdefault(op[5].loop, []).append((_resolve, op[6], wrapped))
        for stream in self._streams.values():
            sends.setdefault(stream.loop, []).append((RequestStream._put, stream, wrapped))
        self._streams.clear()
        _post(sends)

    def _read_stats(self) -> SchedulerStats:
        return self.engine.get_stats()


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (and aborted)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _post(sends: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any, Any]]]) -> None:
    """From the engine thread: one callback per loop runs all of its deliveries."""
    for loop, items in sends.items():
        # A closed loop raises RuntimeError: nobody is listening there any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[Callable, Any, Any]]) -> None:
    for fn, a, b in items:
        fn(a, b)
