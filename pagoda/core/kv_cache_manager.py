"""Which blocks each request holds; prefix-cache lookups. Integers only.

Token positions map onto a request's block table like this (block_size 4):

    tokens      t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block_table [    b5     ,     b2      ,  b9  ]
    slot of t9  = b9 * 4 + 1

Only full blocks are hashed and shared, so a shared block is never written.
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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
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
        num_hit_tokens = len(block_ids) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return block_ids, num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_block_ids: list[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_block_ids` are prefix-cache hits (from `get_computed_blocks`)
        to attach first. Returns the newly allocated block ids, or None, in
        which case nothing was allocated or referenced.
        """
        block_ids = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_after = (
            request.num_computed_tokens
            + len(new_computed_block_ids) * self.block_size
            + num_new_tokens
        )
        num_new_blocks = (
            cdiv(num_tokens_after, self.block_size) - len(block_ids) - len(new_computed_block_ids)
        )
        ref_cnts = self.block_pool.ref_cnts
        # Hits sitting in the free queue stop being free once referenced.
        num_evictable_hits = sum(1 for b in new_computed_block_ids if ref_cnts[b] == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if not block_ids:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_block_ids)
        block_ids.extend(new_computed_block_ids)
        new_block_ids = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        block_ids.extend(new_block_ids)
        self._cache_full_blocks(request, num_tokens_after)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks are evicted first."""
        block_ids = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(block_ids))
        self.req_to_hashes.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)

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

    def _cache_full_blocks(self, request: Request, num_computed_after: int) -> None:
        if not self.enable_caching:
            return
        num_full = num_computed_after // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        block_ids = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.block_pool.cache_full_block(block_ids[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full
