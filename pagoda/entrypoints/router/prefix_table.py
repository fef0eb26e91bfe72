"""The router's picture of which replica holds which prompt blocks.

Two sources feed it. Its own routing history (approximate: every block of a prompt
is recorded for the replica it was sent to, at once, so a burst of one prefix finds
where the first went; it never sees a replica evict). And, with `--kv-events`, each
replica's own prefix cache and KV tier: `follow_kv_events` reads the replica's
`GET /kv_events` stream (a snapshot, then every change; see pagoda.core.kv_events) and
applies it, so blocks a replica evicted stop counting for it, blocks it cached for
requests that came another way start to, and blocks in a tier count, for a little
less, for every replica on that tier.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import httpx

from pagoda.core.kv_events import DISK, POOL, RAM, KVEventBatch

logger = logging.getLogger(__name__)


# What a prefix hit is worth by where the block is: one in a tier saves the prompt's
# compute but costs a read (from host memory, or a file). The weights only order
# replicas: one holding a prefix in its pool beats one that would read it from its
# tier, and that beats one holding none.
MEDIUM_WEIGHT = {POOL: 1.0, RAM: 0.9, DISK: 0.8}


class PrefixTable:
    """Block hash -> who holds it (or was sent it) and where, least recently touched
    first out past `capacity` blocks. A holder is a replica (its pool, its tier's RAM
    part) or a tier's id (its files, which every replica on that tier can read)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.owners: OrderedDict[bytes, set[tuple[int | str, str]]] = OrderedDict()
        self.tier_of: dict[int, str] = {}  # replica -> the tier it reads (from its events)

    def matched(self, hashes: list[bytes], replica: int) -> list[str]:
        """Where `replica` finds each leading block of `hashes` it can find (the
        fastest medium, where it is in several)."""
        reachable = {(replica, POOL), (replica, RAM), (self.tier_of.get(replica), DISK)}
        media = []
        for h in hashes:
            found = [
                medium for holder, medium in self.owners.get(h, ()) if (holder, medium) in reachable
            ]
            if not found:
                break
            media.append(max(found, key=MEDIUM_WEIGHT.__getitem__))
        return media

    def matched_blocks(self, hashes: list[bytes], replica: int) -> int:
        """Leading blocks of `hashes` that `replica` can find, anywhere."""
        return len(self.matched(hashes, replica))

    def score(self, hashes: list[bytes], replica: int) -> float:
        """`replica`'s leading blocks of `hashes`, each weighed by where it is."""
        return sum(MEDIUM_WEIGHT[medium] for medium in self.matched(hashes, replica))

    def record(self, hashes: list[bytes], holder: int | str, medium: str = POOL) -> None:
        for h in hashes:
            owners = self.owners.pop(h, None) or set()
            owners.add((holder, medium))
            self.owners[h] = owners
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)

    def discard(self, hashes: list[bytes], holder: int | str, medium: str = POOL) -> None:
        for h in hashes:
            owners = self.owners.get(h)
            if owners is not None:
                owners.discard((holder, medium))
                if not owners:
                    del self.owners[h]

    def forget(self, replica: int) -> None:
        """A replica that went down comes back with an empty cache (its tier's files
        stay)."""
        self._drop({(replica, POOL), (replica, RAM)})
        self.tier_of.pop(replica, None)

    def apply(self, batch: KVEventBatch, replica: int) -> None:
        """A replica's KV events: what its pool and its tier hold now."""
        tier = batch.tier_id
        if batch.cleared:
            self.forget(replica)
            if tier is not None:  # a snapshot lists the tier's whole directory
                self._drop({(tier, DISK)})
        if tier is not None:
            self.tier_of[replica] = tier
        for holder, medium, changes in (
            (replica, POOL, batch.changes),
            (replica, RAM, batch.tier_changes.get(RAM, {})),
            (tier, DISK, batch.tier_changes.get(DISK, {})),
        ):
            self.discard([h for h, findable in changes.items() if not findable], holder, medium)
            self.record([h for h, findable in changes.items() if findable], holder, medium)

    def _drop(self, entries: set[tuple[int | str, str]]) -> None:
        for h in list(self.owners):
            owners = self.owners[h]
            owners -= entries
            if not owners:
                del self.owners[h]


async def follow_kv_events(
    client: httpx.AsyncClient,
    url: str,
    on_batch: Callable[[KVEventBatch], None],
    retry_s: float = 2.0,
) -> None:
    """Until cancelled: `on_batch` for each batch of `url`'s `/kv_events` stream; when
    the stream breaks, again after `retry_s` (its first batch is then a new snapshot,
    which clears what came before)."""
    while True:
        try:
            async with client.stream("GET", url + "/kv_events") as response:
                if response.status_code != 200:
                    raise httpx.HTTPStatusError(
                        f"/kv_events answered {response.status_code}",
                        request=response.request,
                        response=response,
                    )
                async for line in response.aiter_lines():
                    if line:
                        on_batch(KVEventBatch.from_json(line))
        except (httpx.HTTPError, ValueError) as e:
            logger.info("router: KV events of %s: %r; again in %.1f s", url, e, retry_s)
        await asyncio.sleep(retry_s)
