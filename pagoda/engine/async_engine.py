"""`AsyncEngine`: the synchronous `LLMEngine` behind an asyncio interface.

Three kinds of thread, each with one job:

    caller (any event loop)        processor thread             engine thread
    add_request ── prompt ───────▶ Processor.process ──┐
                ◀─ InvalidRequestError (bad input) ────┘
                ── AddRequest ──────────────────────────────────▶ add_processed_request
    abort       ── AbortRequests ───────────────────────────────▶ abort_request  } between
    RequestStream ◀── call_soon_threadsafe ── outputs ──────────── step()         } steps

Tokenizing and chat templates run on the processor thread, so a long prompt
never blocks an event loop nor delays a step. The engine is not thread-safe:
only the engine thread touches it, applying the queued operations (typed
messages) between steps, stepping while any request is unfinished, and
sleeping on a condition variable when idle. Outputs go back to each
request's `RequestStream` with one callback per loop per step.

If a step raises what the engine cannot pin on one request, the engine is
dead: every stream ends with `EngineDeadError`, new requests are refused, and
`on_dead` is called (the server then exits non-zero for its supervisor).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagoda.core.stats import EngineSnapshot, SchedulerStats
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.messages import (
    AbortAll,
    AbortRequests,
    AddLoRA,
    AddRequests,
    Deliveries,
    EngineOp,
    KVEventListeners,
    KVEventStream,
    ListenKVEvents,
    ProcessedRequest,
    RemoveLoRA,
    RequestStream,
    StopKVEvents,
    TakeSnapshot,
)
from pagoda.engine.processor import PromptType
from pagoda.engine_args import EngineArgs
from pagoda.errors import EngineDeadError, EngineNotAcceptingError, QueueFullError
from pagoda.lora.request import LoRARequest
from pagoda.metrics import EngineMetrics
from pagoda.outputs import RequestOutput
from pagoda.request import SLO
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `LLMEngine` in a background thread; thread-safe, usable from any loop.

    `max_queue_len` bounds the requests accepted but not yet running; past it
    `add_request` raises `QueueFullError`. `on_dead(error)` is called from the
    engine thread if the engine dies.
    """

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        model_name: str | None = None,
        max_queue_len: int | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`engine`: an engine, or a function that builds one. A function runs in the
        engine thread, so that thread is the only one that ever runs torch: a second
        thread's OpenMP pool halves libgomp's spin-wait on 2 cores (measured: a B=1
        decode step 19 -> 28 ms when the engine is built on another thread)."""
        if max_queue_len is not None and max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}.")
        self.max_queue_len = max_queue_len
        self.on_dead = on_dead
        self._cond = threading.Condition()
        # Guarded by _cond: pending operations, the engine's snapshot as of its last
        # loop, and how many requests were added since that snapshot was taken.
        self._ops: list[EngineOp] = []
        self._stats: SchedulerStats | None = None
        self._num_unfinished = 0
        self._num_unseen_adds = 0
        self._accepting = True
        self._stopping = False
        self._error: BaseException | None = None
        self.num_steps = 0
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._kv_listeners = KVEventListeners()  # engine thread only
        self._ids = itertools.count()
        self._processor_pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-processor")
        self._model_name = model_name
        built = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(engine, built), name="pagoda-engine", daemon=True
        )
        self._thread.start()
        built.wait()
        if self._error is not None:  # building the engine failed: the caller's error
            self._processor_pool.shutdown(wait=False)
            raise self._error

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncEngine:
        return cls(lambda: LLMEngine.from_engine_args(engine_args), **kwargs)

    @property
    def model_name(self) -> str:
        return self._model_name or self.engine.model_config.model

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

    @property
    def accepting(self) -> bool:
        """False once the engine stopped or is stopping: new requests are refused."""
        return self._accepting and self.is_running

    def get_stats(self) -> SchedulerStats:
        """The engine's stats as of its last step (see `LLMEngine.get_stats`)."""
        with self._cond:
            return self._stats

    def num_queued(self) -> int:
        """Sequences waiting to run: the engine's waiting count as of its last step,
        plus requests added since (a request with n > 1 waits as n sequences once the
        engine has it)."""
        with self._cond:
            return self._stats.num_requests_waiting + self._num_unseen_adds

    def check_capacity(self, num_new: int = 1) -> None:
        """Raise if `num_new` more requests cannot be accepted now."""
        if self._error is not None:
            raise EngineDeadError("the engine has stopped after an error.") from self._error
        if not self._accepting:
            raise EngineNotAcceptingError("the server is shutting down.")
        if self.max_queue_len is not None and self.num_queued() + num_new > self.max_queue_len:
            raise QueueFullError(
                f"the request queue is full ({self.max_queue_len} waiting); retry later."
            )

    async def run_in_processor(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the processor thread (tokenizing, chat templates, request
        checks: anything that may take long on a big input), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._processor_pool, fn, *args)

    async def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        slo: SLO | None = None,
    ) -> ProcessedRequest:
        """Check and tokenize a request on the processor thread. Raises
        InvalidRequestError (a ValueError naming the field) on bad input."""
        children, text = await self.run_in_processor(
            self.engine.processor.process,
            request_id, prompt, params, priority, arrival_time, lora_request, trace_headers, slo,
        )  # fmt: skip
        return ProcessedRequest(request_id, children, text)

    async def add_processed(self, requests: list[ProcessedRequest]) -> list[RequestStream]:
        """Queue checked requests, all or none (one operation for the engine thread);
        returns their streams once the engine has them. Raises QueueFullError,
        EngineNotAcceptingError, EngineDeadError, InvalidRequestError (a request id in use)
        or DeadlineUnmeetableError (latency targets). Cancelling the caller aborts them."""
        self.check_capacity(len(requests))
        loop = asyncio.get_running_loop()
        streams = [
            RequestStream(
                r.request_id,
                loop,
                r.children[0].sampling_params.output_kind,
                r.children[0].num_prompt_tokens,
            )
            for r in requests
        ]
        op = AddRequests(requests, streams, loop.create_future())
        self._submit(op, num_adds=len(requests))
        try:
            await op.accepted
        except asyncio.CancelledError:
            self.abort([r.request_id for r in requests])
            raise
        return streams

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        slo: SLO | None = None,
    ) -> RequestStream:
        """Check, tokenize and queue one request; returns its stream (see `add_processed`)."""
        self.check_capacity(1)
        processed = await self.process(
            request_id, prompt, params, priority, time.monotonic(), lora_request, trace_headers, slo
        )
        (stream,) = await self.add_processed([processed])
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        slo: SLO | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (of `params.output_kind`) until it finishes.

        Closing or cancelling the iterator early (a client that went away)
        aborts the request in the engine, which frees its blocks.
        """
        if request_id is None:
            request_id = f"async-{next(self._ids)}"
        stream = await self.add_request(
            request_id, prompt, params, priority, lora_request, trace_headers, slo
        )
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Check an adapter on the processor thread (no torch there), then have the
        engine thread read it into its host cache (`LLMEngine.add_lora`). Raises
        InvalidRequestError naming the file and field."""
        self.check_capacity(0)
        await self.run_in_processor(self.engine.processor.check_lora, lora_request)
        op = AddLoRA(lora_request, asyncio.get_running_loop().create_future())
        self._submit(op)
        await op.done

    async def snapshot(self) -> tuple[EngineSnapshot, float]:
        """The engine's state between its next two steps, and the seconds taking it
        cost the engine thread."""
        op = TakeSnapshot(asyncio.get_running_loop().create_future())
        self._submit(op)
        return await op.done

    def listen_kv_events(self) -> KVEventStream:
        """The prefix cache's changes as they happen (call on the loop that reads them):
        first a snapshot (every block hash it can find), then one batch per step that
        changed it. The stream ends if its reader falls too far behind (listen again)
        or the engine stops; `stop_kv_events` when done with it. Raises
        EngineDeadError or EngineNotAcceptingError."""
        if not self._accepting:
            raise EngineNotAcceptingError("the server is shutting down.")
        stream = KVEventStream(asyncio.get_running_loop())
        self._submit(ListenKVEvents(stream))
        return stream

    def stop_kv_events(self, stream: KVEventStream) -> None:
        self._push(StopKVEvents(stream))

    def remove_lora(self, lora_int_id: int) -> None:
        """Free an adapter's memory in the engine (thread-safe, returns at once)."""
        self._push(RemoveLoRA(lora_int_id))

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (thread-safe, returns at once); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._push(AbortRequests(ids))

    def abort_all(self) -> None:
        """Abort every unfinished request; each stream ends with finish_reason "abort"."""
        self._push(AbortAll())

    def stop_accepting(self) -> None:
        """Refuse new requests (EngineNotAcceptingError); running ones go on. KV event
        streams end (their readers would otherwise hold a draining server open)."""
        self._accepting = False
        self._push(StopKVEvents(None))

    def shutdown(self, abort: bool = True, timeout: float | None = None) -> None:
        """Stop the engine thread: abort what is unfinished (or, with abort=False,
        finish it first), then join. Idempotent."""
        self._accepting = False
        with self._cond:
            if abort:
                self._ops.append(AbortAll())
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        self._processor_pool.shutdown(wait=False, cancel_futures=True)

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is unfinished (for tests and drains)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                idle = self._num_unfinished == 0 and not self._ops and not self._num_unseen_adds
            if idle or self._error is not None:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not become idle in time.")
            await asyncio.sleep(0.01)

    def _submit(self, op: EngineOp, num_adds: int = 0) -> None:
        """Queue an operation that the engine thread answers through a future."""
        with self._cond:
            # Under the lock: the engine may have died or stopped since the caller's
            # check, and then nobody would ever answer this operation.
            if self._error is not None:
                raise EngineDeadError("the engine has stopped after an error.") from self._error
            if self._stopping:
                raise EngineNotAcceptingError("the server is shutting down.")
            self._num_unseen_adds += num_adds
            self._ops.append(op)
            self._cond.notify()

    def _push(self, op: EngineOp) -> None:
        with self._cond:
            self._ops.append(op)
            self._cond.notify()

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: threading.Event) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
            self.metrics = EngineMetrics(
                self.model_name,
                self.engine.max_model_len,
                self.get_stats,
                lora_enabled=self.engine.lora_config is not None,
            )
            self.engine.stat_loggers.append(self.metrics)
            self._stats = self.engine.get_stats()
        except BaseException as e:
            self._error = e
            return
        finally:
            built.set()
        try:
            self._loop()
        except BaseException as e:  # a bug or an OOM: fail every request, loudly
            logger.exception("pagoda engine thread died")
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"{e!r}")
            if error is not e:
                error.__cause__ = e
            with self._cond:  # from here no operation is queued (add_processed checks)
                self._error = error
            self._fail_all(error)
            if self.on_dead is not None:
                self.on_dead(error)
        finally:
            self._end_kv_listeners()
            self.engine.shutdown()  # its worker processes, if it has any

    def _loop(self) -> None:
        engine = self.engine
        busy = False
        while True:
            with self._cond:
                while not self._ops and not busy and not self._stopping:
                    if not self._cond.wait(self._kv_listeners.idle_wait(engine)):
                        break
                ops, self._ops = self._ops, []
                stopping = self._stopping
            sends = Deliveries()
            num_adds = 0
            try:
                for op in ops:
                    num_adds += self._apply(op, sends)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self.num_steps += 1
                    for output in outputs:
                        self._send_output(output, sends)
                self._kv_listeners.send(engine.kv_cache_manager, sends)
            except BaseException:
                sends.post()  # what this round already decided goes out before the failure
                raise
            busy = engine.has_unfinished_requests()
            stats = engine.get_stats()
            with self._cond:
                self._stats = stats
                self._num_unfinished = engine.get_num_unfinished_requests()
                self._num_unseen_adds -= num_adds
            sends.post()
            if stopping and not busy:
                with self._cond:
                    if not self._ops:
                        return

    def _apply(self, op: EngineOp, sends: Deliveries) -> int:
        """Apply one operation; returns the number of requests it tried to add."""
        if isinstance(op, AddRequests):
            error = None
            added = []
            try:
                for request in op.requests:
                    self.engine.add_processed_request(
                        request.request_id, request.children, request.prompt_text
                    )
                    added.append(request.request_id)
            except Exception as e:  # a duplicate request id, a deadline: the caller's error
                error = e
                self.engine.abort_request(added)  # all or none
            else:
                for stream in op.streams:
                    self._streams[stream.request_id] = stream
            sends.resolve(op.accepted, error)
            return len(op.requests)
        if isinstance(op, AddLoRA):
            error = None
            try:
                self.engine.add_lora(op.lora_request)
            except Exception as e:
                error = e
            sends.resolve(op.done, error)
            return 0
        if isinstance(op, RemoveLoRA):
            self.engine.remove_lora(op.lora_int_id)
            return 0
        if isinstance(op, TakeSnapshot):
            start = time.perf_counter()
            result = (self.engine.snapshot(), time.perf_counter() - start)
            sends.resolve(op.done, result)
            return 0
        if isinstance(op, ListenKVEvents | StopKVEvents):
            self._kv_listeners.apply(op, self.engine.kv_cache_manager, sends)
            return 0
        ids = list(self._streams) if isinstance(op, AbortAll) else op.request_ids
        for output in self.engine.abort_request(ids):
            self._send_output(output, sends)
        return 0

    def _send_output(self, output: RequestOutput, sends: Deliveries) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        sends.put(stream, output)

    def _fail_all(self, error: BaseException) -> None:
        sends = Deliveries()
        with self._cond:
            ops, self._ops = self._ops, []
        for op in ops:
            if isinstance(op, AddRequests):
                sends.resolve(op.accepted, error)
            elif isinstance(op, AddLoRA | TakeSnapshot):
                sends.resolve(op.done, error)
        self._kv_listeners.streams += [op.stream for op in ops if isinstance(op, ListenKVEvents)]
        for stream in self._streams.values():
            sends.put(stream, error)
        self._streams.clear()
        sends.post()
        self._end_kv_listeners()

    def _end_kv_listeners(self) -> None:
        """The engine stopped: every KV event stream ends (their readers stop waiting)."""
        with self._cond:  # a listen queued after the engine's last round ends too
            ops, self._ops = self._ops, []
        self._kv_listeners.streams += [op.stream for op in ops if isinstance(op, ListenKVEvents)]
        sends = Deliveries()
        self._kv_listeners.end_all(sends)
        sends.post()
