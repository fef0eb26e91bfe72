"""The pool of KV cache blocks: reference counts, the LRU free queue, the prefix cache.

Integers only. A block is an index into the runner's KV cache tensors; this
module never sees them.

    free queue (LRU):  front ──> [b7, b2, b9, ...] <── back
                       evicted first               freed last

A freed block keeps its hash, so a later request can find it again until the
pool hands it to someone else (then its hash is dropped from the cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagoda.core.kv_events import KVEventBatch

# A block's state in `block_map()`.
FREE, CACHED, USED, SHARED = "0", "1", "2", "3"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        # OrderedDict as an O(1) LRU: a cache hit can pull a block from the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # The prefix cache: block hash -> block id. Nothing else.
        self.cached_blocks: dict[bytes, int] = {}
        # While someone listens (a router): how the cache's hashes changed since the
        # last `take_kv_events` (see pagoda.core.kv_events); None when nobody does.
        self.kv_events: KVEventBatch | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def block_map(self) -> str:
        """Each block's state as one character: FREE, CACHED (free but findable by
        its hash, evicted last), USED (one reference) or SHARED (more than one)."""
        hashes = self.block_hashes
        return "".join(
            (SHARED if r > 1 else USED) if r else (FREE if hashes[b] is None else CACHED)
            for b, r in enumerate(self.ref_cnts)
        )

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` from the front of the free queue, each with ref count 1.

        Raises ValueError if there are not enough; callers check first.
        """
        if num_blocks > len(self.free_queue):
            raise ValueError(f"Cannot get {num_blocks} blocks; {len(self.free_queue)} free.")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            self.forget_hash(block_id)
            self.ref_cnts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def get_cached_block(self, block_hash: int) -> int | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a share)."""
        for block_id in block_ids:
            if self.ref_cnts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnts[block_id] += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; those reaching 0 join the back of the
        free queue in the given order (so the first given is evicted first)."""
        for block_id in ordered_block_ids:
            if self.ref_cnts[block_id] <= 0:
                raise RuntimeError(f"Double free of block {block_id}.")
            self.ref_cnts[block_id] -= 1
            if self.ref_cnts[block_id] == 0:
                self.free_queue[block_id] = None

    def cache_full_block(self, block_id: int, block_hash: int) -> None:
        """Make a full block findable by its hash (first writer wins on duplicates)."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        self.block_hashes[block_id] = block_hash
        if block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = block_id
            if self.kv_events is not None:
                self.kv_events.changes[block_hash] = True

    def forget_hash(self, block_id: int) -> None:
        """The block stops being findable by hash (it is evicted, or its content is in doubt)."""
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            return
        self.block_hashes[block_id] = None
        if self.cached_blocks.get(block_hash) == block_id:
            del self.cached_blocks[block_hash]
            if self.kv_events is not None:
                self.kv_events.changes[block_hash] = False

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        self.cached_blocks.clear()
        self.block_hashes = [None] * self.num_blocks
        if self.kv_events is not None:
            self.kv_events = KVEventBatch(cleared=True)
        return True

    def start_kv_events(self) -> KVEventBatch:
        """Record changes from now on (idempotent); returns the cache as it is, as a
        batch that clears what a new listener knew and stores every findable hash."""
        if self.kv_events is None:
            self.kv_events = KVEventBatch()
        return KVEventBatch(dict.fromkeys(self.cached_blocks, True), cleared=True)

    def take_kv_events(self) -> KVEventBatch | None:
        """The changes since the last call (an empty batch if none); None when not
        recording."""
        events = self.kv_events
        if events is not None:
            self.kv_events = KVEventBatch()
        return events

    def stop_kv_events(self) -> None:
        self.kv_events = None
