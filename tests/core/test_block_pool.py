"""BlockPool with tiny sizes: exact block ids, reference counts, LRU eviction order, prefix cache."""

from __future__ import annotations

import pytest

from pagoda.core.block_pool import BlockPool


def free_ids(pool: BlockPool) -> list[int]:
    """The free queue, front (evicted first) to back."""
    return list(pool.free_queue)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert free_ids(pool) == [0, 1, 2, 3]
    assert pool.ref_cnts == [0, 0, 0, 0]
    assert pool.block_hashes == [None] * 4
    assert pool.num_free_blocks == 4
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_rejects_empty_pool(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_get_new_blocks_takes_from_the_front():
    pool = BlockPool(4)
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.ref_cnts == [1, 1, 0, 0]
    assert free_ids(pool) == [2, 3]
    assert pool.get_new_blocks(1) == [2]
    assert pool.ref_cnts == [1, 1, 1, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)


def test_get_zero_blocks():
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert free_ids(pool) == [0, 1]
    assert pool.ref_cnts == [0, 0]


def test_get_new_blocks_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="Cannot get 2 blocks; 1 free"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [2]
    assert pool.ref_cnts == [1, 1, 0]
    # Exactly the number free is fine.
    assert pool.get_new_blocks(1) == [2]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_free_order_is_eviction_order():
    pool = BlockPool(4)
    assert pool.get_new_blocks(4) == [0, 1, 2, 3]
    pool.free_blocks([2, 0])
    assert free_ids(pool) == [2, 0]
    pool.free_blocks([3, 1])
    assert free_ids(pool) == [2, 0, 3, 1]
    assert pool.ref_cnts == [0, 0, 0, 0]
    # The first id given to free_blocks is handed out (evicted) first.
    assert pool.get_new_blocks(3) == [2, 0, 3]
    assert free_ids(pool) == [1]


def test_freed_blocks_join_behind_never_used_ones():
    pool = BlockPool(4)
    assert pool.get_new_blocks(2) == [0, 1]
    pool.free_blocks([1, 0])
    assert free_ids(pool) == [2, 3, 1, 0]
    assert pool.get_new_blocks(4) == [2, 3, 1, 0]


def test_touch_and_free_ref_counts():
    pool = BlockPool(3)
    pool.get_new_blocks(2)  # [0, 1]
    pool.touch([0, 0, 1])
    assert pool.ref_cnts == [3, 2, 0]
    assert free_ids(pool) == [2]
    pool.free_blocks([0, 1])
    assert pool.ref_cnts == [2, 1, 0]
    assert free_ids(pool) == [2]  # still referenced: not free
    pool.free_blocks([1])
    assert pool.ref_cnts == [2, 0, 0]
    assert free_ids(pool) == [2, 1]
    pool.free_blocks([0, 0])
    assert pool.ref_cnts == [0, 0, 0]
    assert free_ids(pool) == [2, 1, 0]


def test_double_free_raises():
    pool = BlockPool(2)
    pool.get_new_blocks(1)
    pool.free_blocks([0])
    with pytest.raises(RuntimeError, match="Double free of block 0"):
        pool.free_blocks([0])
    assert pool.ref_cnts == [0, 0]
    assert free_ids(pool) == [1, 0]


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="Double free of block 1"):
        pool.free_blocks([1])
    assert free_ids(pool) == [0, 1]


def test_cached_block_lookup_by_hash():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    pool.cache_full_block(1, 111)
    assert pool.get_cached_block(111) == 1
    assert pool.get_cached_block(222) is None
    assert pool.block_hashes == [None, 111, None]
    assert pool.cached_blocks == {111: 1}


def test_freed_cached_block_stays_findable_until_reused():
    pool = BlockPool(2)
    pool.get_new_blocks(2)  # [0, 1]
    pool.cache_full_block(0, 111)
    pool.cache_full_block(1, 222)
    pool.free_blocks([0, 1])
    assert free_ids(pool) == [0, 1]
    assert pool.get_cached_block(111) == 0
    assert pool.get_cached_block(222) == 1
    # Handing block 0 out again drops its hash; block 1 keeps its own.
    assert pool.get_new_blocks(1) == [0]
    assert pool.get_cached_block(111) is None
    assert pool.get_cached_block(222) == 1
    assert pool.block_hashes == [None, 222]
    assert pool.cached_blocks == {222: 1}


def test_touch_of_free_cached_block_removes_it_from_free_queue():
    pool = BlockPool(3)
    pool.get_new_blocks(3)
    pool.cache_full_block(1, 111)
    pool.free_blocks([0, 1, 2])
    assert free_ids(pool) == [0, 1, 2]
    pool.touch([pool.get_cached_block(111)])
    assert pool.ref_cnts == [0, 1, 0]
    assert free_ids(pool) == [0, 2]
    # The touched block is skipped by allocation and keeps its hash.
    assert pool.get_new_blocks(2) == [0, 2]
    assert pool.get_cached_block(111) == 1
    # Freed again, it goes to the back and is still findable.
    pool.free_blocks([1])
    assert free_ids(pool) == [1]
    assert pool.get_cached_block(111) == 1


def test_duplicate_hash_first_writer_wins():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    pool.cache_full_block(0, 111)
    pool.cache_full_block(1, 111)
    assert pool.get_cached_block(111) == 0
    assert pool.block_hashes == [111, 111, None]
    # Reusing the duplicate (block 1) leaves the cache pointing at block 0.
    pool.free_blocks([1])
    assert pool.get_new_blocks(2) == [2, 1]
    assert pool.get_cached_block(111) == 0
    assert pool.block_hashes == [111, None, None]


def test_a_cached_block_keeps_its_first_hash():
    pool = BlockPool(1)
    pool.get_new_blocks(1)
    pool.cache_full_block(0, 111)
    pool.cache_full_block(0, 222)
    assert pool.block_hashes == [111]
    assert pool.cached_blocks == {111: 0}


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    pool.get_new_blocks(1)
    pool.cache_full_block(0, 111)
    assert pool.get_cached_block(111) is None
    assert pool.block_hashes == [None, None]
    assert pool.cached_blocks == {}


def test_reset_prefix_cache():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    pool.cache_full_block(0, 111)
    pool.cache_full_block(1, 222)
    pool.free_blocks([1])
    # A block in use: refused, nothing forgotten.
    assert pool.reset_prefix_cache() is False
    assert pool.cached_blocks == {111: 0, 222: 1}
    assert pool.block_hashes == [111, 222, None]
    pool.free_blocks([0])
    assert free_ids(pool) == [2, 1, 0]
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert pool.block_hashes == [None, None, None]
    assert pool.get_cached_block(111) is None
    # The free queue (and so the eviction order) is untouched.
    assert free_ids(pool) == [2, 1, 0]
    assert pool.ref_cnts == [0, 0, 0]


def test_kv_events_follow_the_cache_exactly():
    """A listener that applies the snapshot and then every batch knows exactly the
    hashes the cache can find, whatever the pool did between batches (random
    allocations, frees, hits, duplicate hashes, doubts, resets)."""
    import random

    rng = random.Random(0)
    pool = BlockPool(16)
    assert pool.take_kv_events() is None  # nobody listens: nothing is recorded
    pool.cache_full_block(pool.get_new_blocks(1)[0], b"early")
    held: set[bytes] = set()
    pool.start_kv_events().apply(held)
    assert held == {b"early"}
    used: list[int] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            used += pool.get_new_blocks(1)  # evicts the block's old hash, if any
        elif op < 0.55 and used:
            block = rng.choice(used)
            pool.cache_full_block(block, bytes([rng.randrange(24)]))  # duplicates too
        elif op < 0.8 and used:
            pool.free_blocks([used.pop(rng.randrange(len(used)))])
        elif op < 0.9:
            hit = pool.get_cached_block(bytes([rng.randrange(24)]))
            if hit is not None:
                pool.touch([hit])
                used.append(hit)
        elif op < 0.97 and used:
            pool.forget_hash(rng.choice(used))
        elif not used:
            pool.reset_prefix_cache()
        if step % 7 == 0:
            pool.take_kv_events().apply(held)
            assert held == set(pool.cached_blocks)
    pool.stop_kv_events()
    assert pool.take_kv_events() is None
