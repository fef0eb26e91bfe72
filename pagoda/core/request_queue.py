"""Waiting requests, in the order a scheduling policy serves them (vLLM v1's request queues).

The queue is the whole policy: besides ordering the waiting requests it ranks
running ones, so that the scheduler itself never asks which policy is on.

    fcfs:      waiting in arrival order; a preempted request goes back to the
               front; the victim is the most recently admitted running request.
    priority:  waiting by (priority, arrival time), lower first; a preempted
               request goes back to its place; the victim is the least
               important running request, and a more important waiting
               request may preempt running ones.
    slack:     with latency targets on (core/deadlines.py), either policy orders
               the waiting by slack instead of arrival: the latest time a request
               may start and still meet its TTFT target, earliest first (after
               priority, under the priority policy, which ranks running ones as
               before).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator

from pagoda.request import Request


class RequestQueue(ABC):
    """The waiting requests; `peek()` is the next one to admit."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """A new request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """A preempted request, which goes before new ones of the same rank."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit (the queue must not be empty)."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take `request` out (admitted or aborted); it must be queued."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in the order they would be admitted."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)

    # ---- ranking running requests ----------------------------------------------------

    def order_running(self, running: list[Request]) -> None:
        """Sort `running` in place so that the request to preempt first is last.
        (fcfs: admission order, which the list already has.)"""
        return None

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        """Whether `waiting` may take the place of `running`. (fcfs: never.)"""
        return False

    def ahead_of(self, request: Request) -> Iterator[Request]:
        """The queued requests that would start before `request` were it added now
        (fcfs: all of them)."""
        return iter(self)


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


def _rank(request: Request) -> tuple[float, ...]:
    return request.priority, request.arrival_time


class PriorityQueue(RequestQueue):
    """A heap keyed by (rank, insertion order), lower served first; the rank is
    (priority, arrival time), taken when a request is added."""

    def __init__(self, rank: Callable[[Request], tuple[float, ...]] = _rank) -> None:
        self._rank = rank
        self._heap: list[tuple[tuple[float, ...], int, Request]] = []
        self._order = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._rank(request), next(self._order), request))

    prepend = add  # a preempted request keeps its rank, which puts it back in its place

    def peek(self) -> Request:
        return self._heap[0][-1]

    def remove(self, request: Request) -> None:
        if self._heap[0][-1] is request:
            heapq.heappop(self._heap)
            return
        index = next(i for i, entry in enumerate(self._heap) if entry[-1] is request)
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:2]))

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, request: object) -> bool:
        return any(entry[-1] is request for entry in self._heap)  # no sort: O(n)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=_rank)

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        return waiting.priority < running.priority

    def ahead_of(self, request: Request) -> Iterator[Request]:
        rank = self._rank(request)  # a tie goes before it: it would be added last
        return (entry[-1] for entry in self._heap if entry[0] <= rank)


class SlackQueue(PriorityQueue):
    """Waiting by `latest_start(request)` (core/deadlines.py: its TTFT deadline less its
    estimated prefill), then arrival; after priority when `by_priority`. The key is
    taken when a request is added (a preempted one comes back with a fresh one), so
    the order holds while the estimate moves: every waiting request's slack falls by
    the same clock, and the estimate moves slowly."""

    def __init__(self, latest_start: Callable[[Request], float], by_priority: bool) -> None:
        def rank(r: Request) -> tuple[float, ...]:
            key = (latest_start(r), r.arrival_time)
            return (r.priority, *key) if by_priority else key

        super().__init__(rank)
        self.by_priority = by_priority

    def order_running(self, running: list[Request]) -> None:
        if self.by_priority:
            super().order_running(running)

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        return self.by_priority and super().may_preempt(waiting, running)


def create_request_queue(
    policy: str, latest_start: Callable[[Request], float] | None = None
) -> RequestQueue:
    """The queue for a scheduling policy ("fcfs" | "priority"); with `latest_start`
    (latency targets on), ordered by slack within it."""
    queues = {"fcfs": FCFSQueue, "priority": PriorityQueue}
    if policy not in queues:
        raise ValueError(f"scheduling_policy must be one of {tuple(queues)}, got {policy!r}.")
    if latest_start is not None:
        return SlackQueue(latest_start, by_priority=policy == "priority")
    return queues[policy]()
