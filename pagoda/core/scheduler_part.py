"""The interface between the scheduler's core loop and the features beside it.

The scheduler names budgets, queues and blocks; a feature that changes which
requests start or how far one computes (the encoder budget, LoRA admission,
grammar admission) is a `SchedulerPart` it calls at fixed points of a step, in this
order:

    begin_step(running, head)          once, before anything is scheduled
    admits(request)                    may a waiting request start this step?
    limit_tokens(request, start, n)    how many of n new tokens it may compute
    scheduled(request, start, n)       it computes start..start+n-1: charge it
    computed(request)                  its step came back (num_computed advanced)
    token_appended(request, token)     a new output token; a status ends it
    released(request, finished)        it left the device: finished or preempted

Each part owns its state and is tested alone; the defaults do nothing.
"""

from __future__ import annotations

from pagoda.request import Request, RequestStatus


class SchedulerPart:
    def begin_step(self, running: list[Request], head: Request | None) -> None:
        """A step starts. `running`: the running requests, most important first;
        `head`: the waiting queue's next request (None: empty)."""

    def admits(self, request: Request) -> bool:
        """Whether the waiting `request` may start running this step."""
        return True

    def limit_tokens(self, request: Request, start: int, num_new: int) -> int:
        """At most `num_new`: how many tokens from position `start` the request may
        compute this step as far as this part is concerned."""
        return num_new

    def scheduled(self, request: Request, start: int, num_new: int) -> None:
        """The request computes positions start..start+num_new-1 in this step."""

    def computed(self, request: Request) -> None:
        """The request's step came back; `num_computed_tokens` has advanced."""

    def token_appended(self, request: Request, token_id: int) -> RequestStatus | None:
        """A token was appended to the request's output; a status finishes it."""
        return None

    def released(self, request: Request, finished: bool) -> None:
        """The request left the device: it finished (or was aborted), or was preempted
        (`finished` False) and will come back through the waiting queue."""
