"""The typed messages between callers and the async engine's thread: the operations
the engine thread applies between steps (`EngineOp`), and the streams it answers on
(`RequestStream` per request, `KVEventStream` per KV event listener), each read by
the event loop that owns it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.core.kv_events import KVEventBatch
from pagoda.errors import RequestFailedError
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.request import Request
from pagoda.sampling_params import RequestOutputKind


@dataclass
class ProcessedRequest:
    """A request the Processor has checked and tokenized, ready for the engine."""

    request_id: str
    children: list[Request]
    prompt_text: str | None


@dataclass
class AddRequests:
    """Queue these requests, all or none; `accepted` resolves on the caller's loop."""

    requests: list[ProcessedRequest]
    streams: list[RequestStream]
    accepted: asyncio.Future


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class AbortAll:
    pass


@dataclass
class AddLoRA:
    """Read a checked adapter into the engine's host cache; `done` resolves when it is
    there (or with the error that kept it out)."""

    lora_request: LoRARequest
    done: asyncio.Future


@dataclass
class RemoveLoRA:
    """Free an adapter's slot and host copy."""

    lora_int_id: int


@dataclass
class TakeSnapshot:
    """The engine's state between two steps (`LLMEngine.snapshot`), for the dashboard;
    `done` resolves with it and with the seconds the engine thread spent on it."""

    done: asyncio.Future


@dataclass
class ListenKVEvents:
    """Send the prefix cache's changes to `stream`, from a snapshot taken now."""

    stream: KVEventStream


@dataclass
class StopKVEvents:
    stream: KVEventStream | None  # None: every stream (the server is draining)


EngineOp = (
    AddRequests
    | AbortRequests
    | AbortAll
    | AddLoRA
    | RemoveLoRA
    | TakeSnapshot
    | ListenKVEvents
    | StopKVEvents
)


class KVEventStream:
    """One listener's KV event batches (see pagoda.core.kv_events), as an async
    iterator: first a snapshot of the prefix cache, then each step's changes. A
    listener more than `MAX_PENDING` batches behind is dropped: its iteration ends,
    and it should listen again (from a new snapshot). Only the owning loop reads it."""

    MAX_PENDING = 1024

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ended = False
        self._items: deque[KVEventBatch] = deque()
        self._ready = asyncio.Event()

    def _put(self, batch: KVEventBatch | None) -> None:  # on self.loop; None: the end
        if batch is None or len(self._items) >= self.MAX_PENDING:
            self.ended = True
            self._items.clear()
        elif not self.ended:
            self._items.append(batch)
        self._ready.set()

    def __aiter__(self) -> KVEventStream:
        return self

    async def __anext__(self) -> KVEventBatch:
        while not self._items:
            if self.ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Outputs are of the kind the request's params ask (`output_kind`). A reader
    that falls behind gets what piled up as one output: deltas concatenated, or
    the newest cumulative one. The last item has `finished=True` (finish_reason
    "abort" when it was aborted). A request that failed alone raises
    `RequestFailedError`; if the engine died, `EngineDeadError`. Only the owning
    loop reads it.
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        num_prompt_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.output_kind = output_kind
        self.num_prompt_tokens = num_prompt_tokens
        self.finished = False
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def _put(self, item: RequestOutput | BaseException) -> None:  # on self.loop
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        merged: RequestOutput | None = None
        while self._items:
            item = self._items[0]
            if isinstance(item, BaseException) or item.error is not None:
                if merged is not None:  # what came before the failure goes out first
                    self._ready.set()
                    return merged
                self._items.popleft()
                self.finished = True
                if isinstance(item, BaseException):
                    raise item
                raise RequestFailedError(item.error, item.error_is_client)
            self._items.popleft()
            if merged is None or self.output_kind != RequestOutputKind.DELTA:
                merged = item
            else:
                merged.add(item)
        if merged.finished:
            self.finished = True
        return merged


class Deliveries:
    """What one round of the engine thread hands to event loops (stream items, future
    outcomes); `post` gives each loop one callback that delivers all of its own."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any, Any]]] = {}

    def put(self, stream: RequestStream | KVEventStream, item: Any) -> None:
        self._by_loop.setdefault(stream.loop, []).append((type(stream)._put, stream, item))

    def resolve(self, future: asyncio.Future, outcome: Any) -> None:
        """An exception fails the future; anything else is its result."""
        self._by_loop.setdefault(future.get_loop(), []).append((_resolve, future, outcome))

    def post(self) -> None:
        for loop, items in self._by_loop.items():
            # A closed loop raises RuntimeError: nobody is listening there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)
        self._by_loop = {}


def _resolve(future: asyncio.Future, outcome: Any) -> None:
    if future.done():  # the caller gave up (and aborted)
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _deliver(items: list[tuple[Callable, Any, Any]]) -> None:
    for fn, a, b in items:
        fn(a, b)


class KVEventListeners:
    """The KV event streams the engine thread feeds (engine thread only)."""

    TIER_EVENTS_S = 0.5  # how often an idle engine sends its KV tier's events

    def __init__(self) -> None:
        self.streams: list[KVEventStream] = []

    def idle_wait(self, engine) -> float | None:
        """How long an idle engine thread may sleep: while someone listens to a KV
        tier, they hear what its writer did after the step that finished a request."""
        return self.TIER_EVENTS_S if self.streams and engine.kv_tier is not None else None

    def apply(self, op: ListenKVEvents | StopKVEvents, kv_cache, sends: Deliveries) -> None:
        """`kv_cache`: the engine's KVCacheManager (its pool's and tier's events)."""
        if isinstance(op, ListenKVEvents):
            snapshot = kv_cache.start_kv_events()
            self.send(kv_cache, sends)  # what changed before it is in the snapshot
            self.streams.append(op.stream)
            sends.put(op.stream, snapshot)
            return
        ended = self.streams if op.stream is None else [op.stream]
        for stream in [s for s in ended if s in self.streams]:
            self.streams.remove(stream)
            sends.put(stream, None)
        if not self.streams:
            kv_cache.stop_kv_events()

    def send(self, kv_cache, sends: Deliveries) -> None:
        """The changes since the last batch, to every stream."""
        if not self.streams:
            return
        batch = kv_cache.take_kv_events()
        if batch:
            for stream in self.streams:
                sends.put(stream, batch)

    def end_all(self, sends: Deliveries) -> None:
        for stream in self.streams:
            sends.put(stream, None)
        self.streams.clear()
