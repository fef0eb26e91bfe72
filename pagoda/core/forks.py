"""Parallel sampling (n > 1) in the scheduler: the siblings of a request wait until
their leader has computed all but the last prompt token, then share its blocks (a
fork: reference counts, copy-on-write) instead of computing the prompt again."""

from __future__ import annotations

import time

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.request import Request, RequestStatus


class Forks:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.waiters: dict[str, list[Request]] = {}  # leader id -> siblings waiting for it

    def add(self, leader: Request, siblings: list[Request]) -> None:
        if siblings:
            self.waiters[leader.request_id] = siblings

    def token_limit(self, request: Request) -> int:
        """How far the request may compute: all its tokens, or a leader up to its fork point."""
        if request.request_id in self.waiters:
            return request.num_prompt_tokens - 1
        return request.num_tokens

    def fork_if_ready(self, leader: Request) -> list[Request]:
        """If `leader` has reached its fork point, its siblings start running with its
        blocks and computed tokens (status RUNNING); returns them (the scheduler puts
        them in its running list)."""
        if leader.num_computed_tokens != leader.num_prompt_tokens - 1:
            return []
        siblings = self.waiters.pop(leader.request_id, [])
        for sibling in siblings:
            self.share(leader, sibling)
        return siblings

    def share(self, parent: Request, child: Request) -> None:
        """`child` starts running with `parent`'s blocks and computed tokens."""
        self.kv_cache_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        if child.first_scheduled_time is None:
            child.first_scheduled_time = time.monotonic()

    def drop_sibling(self, request: Request) -> bool:
        """Take a waiting sibling out (it was aborted); False if it is not one."""
        for siblings in self.waiters.values():
            if request in siblings:
                siblings.remove(request)
                return True
        return False

    def leader_left(self, leader: Request) -> list[Request]:
        """A leader that finishes before its fork point hands its siblings back, to be
        queued as requests of their own."""
        return self.waiters.pop(leader.request_id, [])
