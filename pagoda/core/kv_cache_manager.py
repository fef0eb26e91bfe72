"""Which blocks each request holds; prefix-cache lookups. Integers only.

Token positions map onto a request's block table like this (block_size 4):

    tokens      t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block_table [    b5     ,     b2      ,  b9  ]
    slot of t9  = b9 * 4 + 1

A full block becomes findable by hash as soon as it is allocated for the step
that computes it, so requests admitted in the same step share it. Blocks are also shared by forking
(parallel sampling): a shared partial block is copied before it is written
(copy-on-write), and the copies are handed to the runner as (src, dst) pairs.

Preemption by swapping moves a request's blocks to a host pool of the same
shape; the (device, host) pairs are handed to the runner the same way.

Where every layer of the model attends through a sliding window, blocks wholly
behind the window of a request's next token are given back as it moves on; their
table entries become NO_BLOCK (always a leading run; the runner reads them as block
0 and never looks at them), so a long sequence holds about window + chunk tokens
of blocks. A prefix-cache hit then needs only the blocks the window reaches:

    window 6, block_size 4, next token at position 12:
    positions   0..3 | 4..7 | 8..11 | 12..
    block_table [ -1 ,  b2  ,  b9   , b4 ]   (keys 7.. are visible: block 0 is not)

With a disk tier (pagoda.core.kv_tier), the computed full blocks of a request that
finishes (or is aborted) go to the tier's writer thread, unless the tier holds them
already; each keeps one more reference until the writer has copied it (so no step
reuses it first), given back once a step (`release_saved`), or at once where the room
is needed. A prefix
lookup that misses in memory goes on in the tier, and each block found there gets a
fresh block, filled by the runner before the step (`blocks_to_load`) instead of
computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.core.block_pool import BlockPool
from pagoda.core.kv_events import KVEventBatch
from pagoda.core.kv_tier import KVTier
from pagoda.core.stats import KVCacheStats
from pagoda.request import Request

NO_BLOCK = -1  # a block table entry behind every sliding window: given back
FROM_TIER = -2  # a prefix hit in the disk tier (get_computed_blocks): allocated, then loaded


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _held(block_ids) -> list[int]:
    return [b for b in block_ids if b != NO_BLOCK]


def hash_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: object = None
) -> bytes:
    """A full block's key: a 128-bit BLAKE2b digest of its parent's key and its token ids
    (and `extra_key`, e.g. an adapter), so equal keys mean equal prefixes. Python's
    `hash()` is 64 bits and, on tuples of small ints, collides by construction."""
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)  # the parent is 16 bytes or none
    h.update(array("q", token_ids).tobytes())  # fixed length for a given block size
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return h.digest()


@dataclass
class RequestBlocks:
    """What the manager holds for one request."""

    block_ids: list[int] = field(default_factory=list)  # its block table on the device
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, computed once
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    host_block_ids: list[int] | None = None  # while swapped out


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        dtype: str = "auto",
        bytes_per_token: tuple[int, int] = (0, 0),
        sliding_window: int | None = None,
        tier: KVTier | None = None,
    ) -> None:
        """`dtype`, `bytes_per_token` (a token's K/V, and what expanded K and V would
        take): what the blocks hold, for the stats (the runner's cache decides it).
        `sliding_window`: where every layer of the model has one, the largest (blocks
        behind it are given back); None otherwise. `tier`: the disk tier, if any (the
        engine refuses it where every layer slides)."""
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_token = bytes_per_token
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.host_pool = (
            BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks else None
        )
        self.requests: dict[str, RequestBlocks] = {}
        self.num_swapped = 0  # requests whose blocks are in the host pool
        # Block moves the runner must do before the next forward, drained by take_block_ops().
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.blocks_to_swap_out: list[tuple[int, int]] = []  # (device, host)
        self.blocks_to_swap_in: list[tuple[int, int]] = []  # (host, device)
        self.tier = tier
        self.blocks_to_load: list[tuple[int, bytes]] = []  # (block, payload from the tier)
        self._staged_for: str | None = None  # the request whose tier hits are staged
        self.tier_hits = 0  # prompt tokens found in the tier (of the prefix cache's hits)
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's device block table (empty if it holds none)."""
        record = self.requests.get(request_id)
        return list(record.block_ids) if record is not None else []

    def num_blocks_of(self, request_id: str) -> int:
        record = self.requests.get(request_id)
        return len(record.block_ids) if record is not None else 0

    def block_tables(self) -> dict[str, list[int]]:
        """Copies of every block table that holds device blocks (for checks and tests)."""
        return {rid: list(r.block_ids) for rid, r in self.requests.items() if r.block_ids}

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks starting the request's tokens.

        Returns (block ids, number of tokens they hold). At least one token is
        always left to compute, since its logits are needed. Takes no reference:
        pass the ids to `allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        found = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None and not self.sliding_window:
                break
            found.append(block_id)
        if not self.sliding_window:
            if self.tier is not None and len(found) < max_blocks and not request.lora_int_id:
                found += [FROM_TIER] * self._stage(request, hashes[len(found) : max_blocks])
            return found, len(found) * self.block_size
        # The longest prefix whose blocks within the next token's window are all cached;
        # the blocks before them are NO_BLOCK (no query will read them).
        for n in range(len(found), 0, -1):
            first = self._first_needed(n * self.block_size)
            if all(b is not None for b in found[first:n]):
                return [NO_BLOCK] * first + found[first:n], n * self.block_size
        return [], 0

    def _stage(self, request: Request, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the tier holds (read and checked now,
        at most as many as there are free blocks to load them into)."""
        if self._staged_for != request.request_id:  # one request's reads held at a time
            self.tier.drop_staged()
            self._staged_for = request.request_id
        self._has_room(len(hashes))  # (the blocks the writer holds may be what is missing)
        return self.tier.stage(hashes[: self.block_pool.num_free_blocks])

    def _first_needed(self, position: int) -> int:
        """The first block a query at `position` (and every later one) may read."""
        return max(0, position - self.sliding_window + 1) // self.block_size

    def _free_behind_window(self, record: RequestBlocks, num_computed: int) -> None:
        """Give back the blocks no query from position `num_computed` on can see (they
        stay findable by hash until the pool hands them out again)."""
        first = min(self._first_needed(num_computed), len(record.block_ids))
        behind = _held(record.block_ids[:first])
        if behind:
            record.block_ids[:first] = [NO_BLOCK] * first
            self.block_pool.free_blocks(behind)

    def record_prefix_lookup(
        self, num_tokens: int, num_hit_tokens: int, hit_block_ids: Sequence[int] = ()
    ) -> None:
        """Count an admitted request's lookup (a failed admission retries, uncounted)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens
            self.tier_hits += hit_block_ids.count(FROM_TIER) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: list[int] = (),
        num_lookahead: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones, and
        `num_lookahead` past them (speculative drafts: written, maybe rejected, so
        never made findable by hash).

        `new_computed_block_ids` are prefix-cache hits (from `get_computed_blocks`)
        to attach first; those in the tier get new blocks, loaded before the step.
        If the first token written lands in a block shared with
        another request, that block is copied first. Returns the newly allocated
        block ids, or None, in which case nothing was allocated or referenced.
        """
        record = self.requests.get(request.request_id) or RequestBlocks()
        if self.sliding_window and record.block_ids:
            self._free_behind_window(record, request.num_computed_tokens)
        block_ids = record.block_ids
        ref_cnts = self.block_pool.ref_cnts
        num_computed = request.num_computed_tokens + len(new_computed_block_ids) * self.block_size
        num_loads = new_computed_block_ids.count(FROM_TIER)  # (they follow those in memory)
        in_memory = list(new_computed_block_ids[: len(new_computed_block_ids) - num_loads])
        num_new_blocks = (
            cdiv(num_computed + num_new_tokens + num_lookahead, self.block_size)
            - len(block_ids)
            - len(in_memory)
        )
        # Copy-on-write: the partial block we are about to write into is shared.
        cow_index = num_computed // self.block_size
        needs_copy = (
            num_new_tokens > 0
            and num_computed % self.block_size != 0
            and cow_index < len(block_ids)
            and ref_cnts[block_ids[cow_index]] > 1
        )
        # Hits sitting in the free queue stop being free once referenced. (Blocks the
        # tier's writer is done with are given back first: a hit among them must be
        # counted as free here, not found free by the room check below.)
        self.release_saved()
        num_evictable_hits = sum(1 for b in _held(in_memory) if ref_cnts[b] == 0)
        if not self._has_room(num_new_blocks + needs_copy + num_evictable_hits):
            return None
        self.requests[request.request_id] = record
        if needs_copy:
            src = block_ids[cow_index]
            (dst,) = self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([src])
            block_ids[cow_index] = dst
            self.blocks_to_copy.append((src, dst))
        self.block_pool.touch(_held(in_memory))
        block_ids.extend(in_memory)
        new_block_ids = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        for block_id in new_block_ids[:num_loads]:
            block_hash = record.block_hashes[len(block_ids)]
            self.blocks_to_load.append((block_id, self.tier.take(block_hash)))
            block_ids.append(block_id)
        block_ids.extend(new_block_ids[num_loads:])
        # Findable at once: a request admitted later in this same step may share them,
        # since every layer writes the whole step's K/V before any attention reads. (If
        # the step fails for this request, forget_uncomputed takes them back.)
        self.cache_blocks(request, num_computed + num_new_tokens)
        return new_block_ids

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's full blocks up to `num_computed_tokens` findable by hash."""
        if not self.enable_caching:
            return
        record = self.requests[request.request_id]
        num_full = num_computed_tokens // self.block_size
        if num_full <= record.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(record.num_cached_blocks, num_full):
            if record.block_ids[i] != NO_BLOCK:
                self.block_pool.cache_full_block(record.block_ids[i], hashes[i])
        record.num_cached_blocks = num_full

    def free_past(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past the first `num_tokens` tokens' (those held
        for rejected speculative drafts: never hashed, never shared)."""
        record = self.requests.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if record is None or len(record.block_ids) <= keep:
            return
        self.block_pool.free_blocks(reversed(_held(record.block_ids[keep:])))
        del record.block_ids[keep:]

    def forget_uncomputed(self, request: Request) -> set[int]:
        """After a failed step: the request's blocks past its computed tokens may never
        have been written, yet were findable from the moment they were allocated. They
        stop being findable; returns their ids (a request of the same step may hold them)."""
        record = self.requests.get(request.request_id)
        if record is None:
            return set()
        first = request.num_computed_tokens // self.block_size
        suspect = _held(record.block_ids[first:])
        for block_id in suspect:
            self.block_pool.forget_hash(block_id)
        record.num_cached_blocks = min(record.num_cached_blocks, first)
        return set(suspect)

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share every block of `parent` (parallel sampling)."""
        source = self.requests[parent.request_id]
        self.block_pool.touch(_held(source.block_ids))
        self.requests[child.request_id] = RequestBlocks(
            list(source.block_ids), list(source.block_hashes), source.num_cached_blocks
        )

    # ---- swap -------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Move the request's blocks to the host pool; False (nothing done) if it has no room."""
        record = self.requests.get(request.request_id)
        block_ids = _held(record.block_ids) if record is not None else []
        if self.host_pool is None or len(block_ids) > self.host_pool.num_free_blocks:
            return False
        host_ids = self.host_pool.get_new_blocks(len(block_ids))
        self.blocks_to_swap_out.extend(zip(block_ids, host_ids, strict=True))
        behind = len(record.block_ids) - len(block_ids) if record is not None else 0
        self.free(request, save=False)
        self.requests[request.request_id] = RequestBlocks(
            block_ids=[NO_BLOCK] * behind, host_block_ids=host_ids
        )
        self.num_swapped += 1
        return True

    def is_swapped(self, request: Request) -> bool:
        record = self.requests.get(request.request_id)
        return record is not None and record.host_block_ids is not None

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Bring a swapped request's blocks back and make room for `num_new_tokens`.

        Returns the new device block ids, or None (nothing done) if they do not fit.
        """
        record = self.requests[request.request_id]
        host_ids = record.host_block_ids
        behind = len(record.block_ids)  # NO_BLOCK entries: nothing to bring back
        num_needed = max(
            len(host_ids),
            cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - behind,
        )
        if not self._has_room(num_needed):
            return None
        device_ids = self.block_pool.get_new_blocks(len(host_ids))
        self.blocks_to_swap_in.extend(zip(host_ids, device_ids, strict=True))
        self.host_pool.free_blocks(host_ids)
        record.host_block_ids = None
        record.block_ids = [NO_BLOCK] * behind + list(device_ids)
        self.num_swapped -= 1
        extra = self.allocate_slots(request, num_new_tokens)
        return device_ids + extra

    def take_block_ops(self) -> tuple[list, list, list, list]:
        """(copies, swap-outs, swap-ins, loads) since the last call, for the runner
        before the step (see SchedulerOutput for the order it does them in). Once a
        step, so also where the blocks the tier's writer has copied are given back."""
        self.release_saved()
        ops = (
            self.blocks_to_copy,
            self.blocks_to_swap_out,
            self.blocks_to_swap_in,
            self.blocks_to_load,
        )
        self.blocks_to_copy, self.blocks_to_swap_out, self.blocks_to_swap_in = [], [], []
        self.blocks_to_load = []
        return ops

    def free(self, request: Request, save: bool = True) -> None:
        """Release the request's blocks (device and host); tail blocks are evicted first.
        With a tier and `save`, its computed full blocks are written there."""
        record = self.requests.pop(request.request_id, None)
        if record is None:
            return
        if self._staged_for == request.request_id:
            self.tier.drop_staged()
            self._staged_for = None
        if self.tier is not None and save and not request.lora_int_id:  # (adapter ids: ours)
            self._save(record, request.num_computed_tokens)
        self.block_pool.free_blocks(reversed(_held(record.block_ids)))
        if record.host_block_ids is not None:
            self.host_pool.free_blocks(record.host_block_ids)
            self.num_swapped -= 1

    def _save(self, record: RequestBlocks, num_computed_tokens: int) -> None:
        """Hand the record's computed full blocks to the tier's writer, each held until
        it is copied."""
        num_full = min(record.num_cached_blocks, num_computed_tokens // self.block_size)
        pool_hashes = self.block_pool.block_hashes
        for block_id, block_hash in zip(
            record.block_ids[:num_full], record.block_hashes, strict=False
        ):
            if (
                block_id != NO_BLOCK
                and pool_hashes[block_id] == block_hash  # (not forgotten after a failed step)
                and self.tier.save(block_hash, block_id)
            ):
                self.block_pool.touch([block_id])

    def release_saved(self) -> None:
        """Give back the blocks the tier's writer has copied."""
        if self.tier is not None:
            # Tail first, as a finished request's own blocks are: the pool evicts the
            # oldest free block first, and a prefix's head is the most shared part.
            self.block_pool.free_blocks(self.tier.take_saved()[::-1])

    def _has_room(self, num_blocks: int) -> bool:
        """Whether `num_blocks` are free, after waiting for the tier's writer to copy
        the blocks it holds if that is what it takes (a copy is short; a preemption
        for want of them would not be)."""
        if num_blocks <= self.block_pool.num_free_blocks or self.tier is None:
            return num_blocks <= self.block_pool.num_free_blocks
        self.release_saved()
        if num_blocks > self.block_pool.num_free_blocks and self.tier.num_copying:
            self.tier.wait_copied()
            self.release_saved()
        return num_blocks <= self.block_pool.num_free_blocks

    # ---- KV events (pagoda.core.kv_events): the pool's, and the tier's ----------------

    def start_kv_events(self) -> KVEventBatch:
        """Record changes from now on; returns a snapshot batch of what is findable."""
        batch = self.block_pool.start_kv_events()
        if self.tier is not None:
            batch.tier_id, batch.tier_changes = self.tier.tier_id, self.tier.start_events()
        return batch

    def take_kv_events(self) -> KVEventBatch | None:
        """The changes since the last call; None when not recording."""
        batch = self.block_pool.take_kv_events()
        if batch is not None and self.tier is not None:
            batch.tier_id, batch.tier_changes = self.tier.tier_id, self.tier.take_events()
        return batch

    def stop_kv_events(self) -> None:
        self.block_pool.stop_kv_events()
        if self.tier is not None:
            self.tier.stop_events()

    @property
    def usage(self) -> float:
        return self.block_pool.num_used_blocks / self.block_pool.num_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            dtype=self.dtype,
            block_size=self.block_size,
            num_blocks_total=self.block_pool.num_blocks,
            num_blocks_used=self.block_pool.num_used_blocks,
            num_requests_swapped=self.num_swapped,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            bytes_per_token=self.bytes_per_token[0],
            expanded_bytes_per_token=self.bytes_per_token[1],
            tier=self.tier.snapshot() if self.tier is not None else None,
            tier_hit_tokens=self.tier_hits,
        )

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        record = self.requests.setdefault(request.request_id, RequestBlocks())
        hashes = record.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        # The same tokens under another adapter hold other K/V: the adapter keys the
        # chain's first block, and through it every later one.
        # The same placeholder tokens with another image hold other K/V too: each block
        # is keyed by the images it covers (and where they start in it).
        adapter = request.lora_int_id or None
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            extra = adapter if parent is None else None
            start, end = i * bs, (i + 1) * bs
            images = tuple(
                (f.hash, f.offset - start)
                for f in request.mm_features
                if f.offset < end and f.offset + f.length > start
            )
            if images:
                extra = (extra, images)
            hashes.append(hash_block(parent, tokens[start:end], extra))
        return hashes
