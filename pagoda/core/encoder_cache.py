"""The scheduler's ledger of the model runner's encoder cache: which images' encoder
outputs the runner holds (by content hash), how many rows each takes, and which
requests still need each one.

An output is needed by a request from the step that first computes any of its image's
placeholder positions until the request has computed past them. Outputs nobody needs
stay, least recently released first out, so that a later request with the same image
(or a preempted one coming back) does not run the encoder again; they are evicted
only to make room. The runner drops what `take_evicted` reports.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # rows (image tokens) the runner may hold
        self.sizes: dict[str, int] = {}  # hash -> rows, of every held output
        self.users: dict[str, set[str]] = {}  # hash -> requests that still need it
        self.unused: OrderedDict[str, None] = OrderedDict()  # held, needed by none: LRU first
        self.num_used = 0
        self.evicted: list[str] = []
        self.queries = self.hits = 0  # images looked up, and found held

    def holds(self, image_hash: str) -> bool:
        return image_hash in self.sizes

    def can_hold(self, rows: int, keep: Collection[str] = ()) -> bool:
        """Whether `rows` more fit once every output nobody needs is evicted, but those
        in `keep` (about to be needed); an output larger than the whole cache fits only
        when nothing else is needed."""
        needed = self.num_used - sum(self.sizes[h] for h in self.unused if h not in keep)
        return needed + rows <= self.capacity or needed == 0

    def add(self, image_hash: str, rows: int) -> None:
        """Account for a new output, evicting outputs nobody needs to make room."""
        while self.num_used + rows > self.capacity and self.unused:
            victim, _ = self.unused.popitem(last=False)
            self.num_used -= self.sizes.pop(victim)
            self.evicted.append(victim)
        self.sizes[image_hash] = rows
        self.num_used += rows

    def use(self, image_hash: str, request_id: str) -> None:
        self.users.setdefault(image_hash, set()).add(request_id)
        self.unused.pop(image_hash, None)

    def release(self, image_hash: str, request_id: str) -> None:
        users = self.users.get(image_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            del self.users[image_hash]
            if image_hash in self.sizes:
                self.unused[image_hash] = None

    def take_evicted(self) -> list[str]:
        evicted, self.evicted = self.evicted, []
        return evicted
