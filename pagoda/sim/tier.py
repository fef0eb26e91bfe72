"""The disk KV tier, simulated: what `KVCacheManager` asks of `pagoda.core.kv_tier.KVTier`
(`stage`, `take`, `drop_staged`, `save`, `take_saved`, `wait_copied`, `num_copying`,
`flush`, `holds`, `snapshot`, the events), with no files and no thread.

`TierStore` stands for the directory: an index of block hashes, least recently used
first, under a byte budget. `SimTier` is one replica's tier on it (what it has staged,
what it has copied, its stats); replicas given one store share it, as servers on one
directory do (a block one writes, another finds). Writing is immediate and costs no
step time (the real writer copies off the step, at the lowest priority); reading
costs step time, which the replica adds from `bytes_read`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from pagoda.core.kv_events import DISK, RAM
from pagoda.core.kv_tier import HEADER_BYTES, TierStats


class TierStore:
    def __init__(self, max_bytes: int, block_bytes: int) -> None:
        """`block_bytes`: one block's K/V; a file adds the real tier's header."""
        self.max_bytes = max_bytes
        self.file_bytes = block_bytes + HEADER_BYTES
        self.index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.blocks_removed = 0  # the budget's evictions

    @property
    def num_bytes(self) -> int:
        return len(self.index) * self.file_bytes

    def add(self, block_hash: bytes) -> list[bytes]:
        """Store a block; returns those the budget evicted."""
        self.index[block_hash] = None
        evicted = []
        while self.num_bytes > self.max_bytes and self.index:
            evicted.append(self.index.popitem(last=False)[0])
            self.blocks_removed += 1
        return evicted


class SimTier:
    def __init__(self, store: TierStore) -> None:
        self.store = store
        self.tier_id = f"sim-{id(store):x}"  # (replicas given one store share it)
        self.stats = TierStats()
        self._events: dict[bytes, bool] | None = None  # (this replica's saves and evictions)
        self.num_copying = 0  # (copies are immediate)
        self._staged: set[bytes] = set()
        self._copied: list[int] = []

    def __len__(self) -> int:
        return len(self.store.index)

    def snapshot(self) -> TierStats:
        store = self.store
        return replace(self.stats, stored_blocks=len(store.index), stored_bytes=store.num_bytes,
                       blocks_removed=store.blocks_removed)  # fmt: skip

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.store.index

    def stage(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are here; each "read" (counted, and
        made the most recently used) unless staged already."""
        index, n = self.store.index, 0
        for block_hash in hashes:
            if block_hash not in self._staged:
                self.stats.queries += 1
                if block_hash not in index:
                    break
                index.move_to_end(block_hash)
                self._staged.add(block_hash)
                self.stats.hits += 1
                self.stats.bytes_read += self.store.file_bytes
            n += 1
        return n

    def take(self, block_hash: bytes) -> bytes:
        self._staged.remove(block_hash)
        return b""  # (the stand-in runner loads nothing)

    def drop_staged(self) -> None:
        self._staged.clear()

    def save(self, block_hash: bytes, block_id: int) -> bool:
        """Written at once; the block comes back from the next `take_saved`."""
        if block_hash in self.store.index:
            return False
        evicted = self.store.add(block_hash)
        if self._events is not None:
            self._events.update(dict.fromkeys(evicted, False))
            self._events[block_hash] = block_hash in self.store.index
        self.stats.bytes_written += self.store.file_bytes
        self._copied.append(block_id)
        return True

    def take_saved(self) -> list[int]:
        copied, self._copied = self._copied, []
        return copied

    def wait_copied(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def start_events(self) -> dict[str, dict[bytes, bool]]:
        self._events = {}
        return {RAM: {}, DISK: dict.fromkeys(self.store.index, True)}

    def take_events(self) -> dict[str, dict[bytes, bool]]:
        if self._events is None:
            return {}
        events, self._events = self._events, {}
        return {RAM: {}, DISK: events}

    def stop_events(self) -> None:
        self._events = None
