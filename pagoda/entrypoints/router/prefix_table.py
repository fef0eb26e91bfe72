"""The router's picture of which replica holds which prompt blocks.

Two sources feed it. Its own routing history (approximate: every block of a prompt
is recorded for the replica it was sent to, at once, so a burst of one prefix finds
where the first went; it never sees a replica evict). And, with `--kv-events`, each
replica's own prefix cache: `follow_kv_events` reads the replica's `GET /kv_events`
stream (a snapshot, then every change; see pagoda.core.kv_events) and applies it, so
blocks a replica evicted stop counting for it and blocks it cached for requests that
came another way start to.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import httpx

from pagoda.core.kv_events import KVEventBatch

logger = logging.getLogger(__name__)


class PrefixTable:
    """Block hash -> the replicas that hold it (or were sent it), least recently
    touched first out past `capacity` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.owners: OrderedDict[bytes, set[int]] = OrderedDict()

    def matched_blocks(self, hashes: list[bytes], replica: int) -> int:
        """Leading blocks of `hashes` that `replica` holds."""
        n = 0
        for h in hashes:
            owners = self.owners.get(h)
            if owners is None or replica not in owners:
                break
            n += 1
        return n

    def record(self, hashes: list[bytes], replica: int) -> None:
        for h in hashes:
            owners = self.owners.pop(h, None) or set()
            owners.add(replica)
            self.owners[h] = owners
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)

    def discard(self, hashes: list[bytes], replica: int) -> None:
        for h in hashes:
            owners = self.owners.get(h)
            if owners is not None:
                owners.discard(replica)
                if not owners:
                    del self.owners[h]

    def forget(self, replica: int) -> None:
        """A replica that went down comes back with an empty cache."""
        for owners in self.owners.values():
            owners.discard(replica)

    def apply(self, batch: KVEventBatch, replica: int) -> None:
        """A replica's KV events: what its prefix cache holds now."""
        if batch.cleared:
            self.forget(replica)
        self.discard([h for h, findable in batch.changes.items() if not findable], replica)
        self.record([h for h, findable in batch.changes.items() if findable], replica)


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
