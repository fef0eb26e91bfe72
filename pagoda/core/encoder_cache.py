"""The scheduler's ledger of the model runner's encoder cache: which images' encoder
outputs the runner holds (by content hash), how many rows each takes, and which
requests still need each one.

An output is needed by a request from the step that first computes any of its image's
placeholder positions until the request has computed past them. Outputs nobody needs
stay, least recently released first out, so that a later request with the same image
(or a preempted one coming back) does not run the encoder again; they are evicted
only to make room. The runner drops what `take_evicted` reports.

`EncoderBudget` is the scheduler's part for images: it owns the ledger, the step's
encoder budget and the cache's hit counters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from pagoda.core.scheduler_part import SchedulerPart
from pagoda.request import Request


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # rows (image tokens) the runner may hold
        self.sizes: dict[str, int] = {}  # hash -> rows, of every held output
        self.users: dict[str, set[str]] = {}  # hash -> requests that still need it
        self.unused: OrderedDict[str, None] = OrderedDict()  # held, needed by none: LRU first
        self.num_used = 0
        self.evicted: list[str] = []

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

    def needed_by(self, image_hash: str, request_id: str) -> bool:
        return request_id in self.users.get(image_hash, ())

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


class EncoderBudget(SchedulerPart):
    """Images: a step encodes at most `budget` image rows (vLLM's default, the token
    budget), and a chunk stops before an image whose encoder output is not held and
    does not fit that budget or the encoder cache (an image larger than the whole
    budget runs alone in a step's encoder work)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.cache = EncoderCacheManager(budget)
        self.step_budget = budget  # rows left to encode in this step
        self.queries = self.hits = 0  # images looked up, and found held

    def begin_step(self, running: list[Request], head: Request | None) -> None:
        self.step_budget = self.budget

    def limit_tokens(self, request: Request, start: int, num_new: int) -> int:
        if not request.mm_features:
            return num_new
        cache, budget, rows = self.cache, self.step_budget, 0
        # Held outputs this chunk covers will be taken (`scheduled`): not room to evict.
        keep = {f.hash for f in request.features_in(start, start + num_new) if cache.holds(f.hash)}
        for feature in request.features_in(start, start + num_new):
            if cache.holds(feature.hash):
                continue
            first = budget == self.budget
            if (feature.length <= budget or first) and cache.can_hold(rows + feature.length, keep):
                budget -= feature.length
                rows += feature.length
                continue
            return feature.offset - start
        return num_new

    def scheduled(self, request: Request, start: int, num_new: int) -> None:
        """Each image the chunk covers is held for the request from now on; a new one is
        charged to the step's budget. Held ones are taken first, so making room for a
        new one never evicts them."""
        cache, request_id = self.cache, request.request_id
        features = request.features_in(start, start + num_new)
        for feature in features:
            if not cache.needed_by(feature.hash, request_id):
                self.queries += 1
                self.hits += cache.holds(feature.hash)
            if cache.holds(feature.hash):
                cache.use(feature.hash, request_id)
        for feature in features:
            if not cache.holds(feature.hash):
                cache.add(feature.hash, feature.length)
                self.step_budget -= feature.length
                cache.use(feature.hash, request_id)

    def computed(self, request: Request) -> None:
        self._release(request, request.num_computed_tokens)

    def released(self, request: Request, finished: bool) -> None:
        self._release(request, None)

    def _release(self, request: Request, computed: int | None) -> None:
        """Let go of the images the request no longer needs: all of them (computed None),
        or those wholly before `computed` that do not come again after it."""
        ahead = (
            set()
            if computed is None
            else {f.hash for f in request.mm_features if f.offset + f.length > computed}
        )
        for feature in request.mm_features:
            if feature.hash not in ahead:
                self.cache.release(feature.hash, request.request_id)
