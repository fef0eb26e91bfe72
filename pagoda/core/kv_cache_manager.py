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
"""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(
    parent_hash: int | None, token_ids: tuple[int, ...], extra_key: object = None
) -> int:
    """A full block's key: chained from its parent's, so equal keys mean equal prefixes."""
    return hash((parent_hash, token_ids, extra_key))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.host_pool = (
            BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks else None
        )
        self.req_to_host_blocks: dict[str, list[int]] = {}  # swapped-out requests
        # Block moves the runner must do before the next forward, drained by take_block_ops().
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.blocks_to_swap_out: list[tuple[int, int]] = []  # (device, host)
        self.blocks_to_swap_in: list[tuple[int, int]] = []  # (host, device)
        self.req_to_blocks: dict[str, list[int]] = {}
        # Hashes of each request's full blocks, computed once per block.
        self.req_to_hashes: dict[str, list[int]] = {}
        # How many of each request's blocks are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

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
        block_ids = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup (a failed admission retries, uncounted)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_block_ids: list[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_block_ids` are prefix-cache hits (from `get_computed_blocks`)
        to attach first. If the first token written lands in a block shared with
        another request, that block is copied first. Returns the newly allocated
        block ids, or None, in which case nothing was allocated or referenced.
        """
        block_ids = self.req_to_blocks.setdefault(request.request_id, [])
        ref_cnts = self.block_pool.ref_cnts
        num_computed = request.num_computed_tokens + len(new_computed_block_ids) * self.block_size
        num_new_blocks = (
            cdiv(num_computed + num_new_tokens, self.block_size)
            - len(block_ids)
            - len(new_computed_block_ids)
        )
        # Copy-on-write: the partial block we are about to write into is shared.
        cow_index = num_computed // self.block_size
        needs_copy = (
            num_new_tokens > 0
            and num_computed % self.block_size != 0
            and cow_index < len(block_ids)
            and ref_cnts[block_ids[cow_index]] > 1
        )
        # Hits sitting in the free queue stop being free once referenced.
        num_evictable_hits = sum(1 for b in new_computed_block_ids if ref_cnts[b] == 0)
        if num_new_blocks + needs_copy > self.block_pool.num_free_blocks - num_evictable_hits:
            if not block_ids:
                del self.req_to_blocks[request.request_id]
            return None
        if needs_copy:
            src = block_ids[cow_index]
            (dst,) = self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([src])
            block_ids[cow_index] = dst
            self.blocks_to_copy.append((src, dst))
        self.block_pool.touch(new_computed_block_ids)
        block_ids.extend(new_computed_block_ids)
        new_block_ids = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        block_ids.extend(new_block_ids)
        # Findable at once: a request admitted later in this same step may share them,
        # since every layer writes the whole step's K/V before any attention reads.
        # (The scheduler never un-schedules a request it has allocated for.)
        self.cache_blocks(request, num_computed + num_new_tokens)
        return new_block_ids

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's full blocks up to `num_computed_tokens` findable by hash."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        block_ids = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.block_pool.cache_full_block(block_ids[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share every block of `parent` (parallel sampling)."""
        block_ids = list(self.req_to_blocks[parent.request_id])
        self.block_pool.touch(block_ids)
        self.req_to_blocks[child.request_id] = block_ids
        self.req_to_hashes[child.request_id] = list(self.req_to_hashes.get(parent.request_id, []))
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    # ---- swap -------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Move the request's blocks to the host pool; False (nothing done) if it has no room."""
        block_ids = self.req_to_blocks.get(request.request_id, [])
        if self.host_pool is None or len(block_ids) > self.host_pool.num_free_blocks:
            return False
        host_ids = self.host_pool.get_new_blocks(len(block_ids))
        self.blocks_to_swap_out.extend(zip(block_ids, host_ids, strict=True))
        self.free(request)
        self.req_to_host_blocks[request.request_id] = host_ids
        return True

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.req_to_host_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Bring a swapped request's blocks back and make room for `num_new_tokens`.

        Returns the new device block ids, or None (nothing done) if they do not fit.
        """
        host_ids = self.req_to_host_blocks[request.request_id]
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        device_ids = self.block_pool.get_new_blocks(len(host_ids))
        self.blocks_to_swap_in.extend(zip(host_ids, device_ids, strict=True))
        self.host_pool.free_blocks(host_ids)
        del self.req_to_host_blocks[request.request_id]
        self.req_to_blocks[request.request_id] = device_ids
        extra = self.allocate_slots(request, num_new_tokens)
        return device_ids + extra

    def take_block_ops(self) -> tuple[list, list, list]:
        """(copies, swap-outs, swap-ins) since the last call. The runner must do the
        swap-outs first: their device blocks may be reused in the same step."""
        ops = (self.blocks_to_copy, self.blocks_to_swap_out, self.blocks_to_swap_in)
        self.blocks_to_copy, self.blocks_to_swap_out, self.blocks_to_swap_in = [], [], []
        return ops

    def free(self, request: Request) -> None:
        """Release the request's blocks (device and host); tail blocks are evicted first."""
        block_ids = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(block_ids))
        self.req_to_hashes.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        host_ids = self.req_to_host_blocks.pop(request.request_id, None)
        if host_ids:
            self.host_pool.free_blocks(host_ids)

    @property
    def usage(self) -> float:
        return self.block_pool.num_used_blocks / self.block_pool.num_blocks

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return hashes
