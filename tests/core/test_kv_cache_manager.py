"""KVCacheManager with block_size 4: exact block ids, prefix-cache hits, eviction order."""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVCacheManager, cdiv, hash_block
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(), arrival_time=0.0)


def free_ids(manager: KVCacheManager) -> list[int]:
    return list(manager.block_pool.free_queue)


def snapshot(manager: KVCacheManager):
    pool = manager.block_pool
    return (
        list(pool.free_queue),
        list(pool.ref_cnts),
        list(pool.block_hashes),
        dict(pool.cached_blocks),
        manager.block_tables(),
    )


def compute(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does after the runner computed `num_tokens` more tokens."""
    request.num_computed_tokens += num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def test_cdiv():
    assert [cdiv(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_hash_block_is_chained():
    h0 = hash_block(None, (1, 2, 3, 4))
    assert h0 == hash_block(None, (1, 2, 3, 4))
    assert h0 != hash_block(None, (1, 2, 3, 5))
    # Same tokens, different parent: a different key.
    assert hash_block(h0, (5, 6, 7, 8)) != hash_block(None, (5, 6, 7, 8))
    assert hash_block(h0, (5, 6, 7, 8)) == hash_block(h0, (5, 6, 7, 8))


def test_allocate_slots_returns_exact_new_ids():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(10)))
    assert m.allocate_slots(a, 10) == [0, 1, 2]
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.block_pool.ref_cnts == [1, 1, 1, 0, 0, 0]
    assert free_ids(m) == [3, 4, 5]
    compute(m, a, 10)
    # Tokens 10 and 11 still fit in block 2.
    assert m.allocate_slots(a, 2) == []
    assert m.get_block_ids("a") == [0, 1, 2]
    # Tokens 10..12: token 12 needs a fourth block.
    assert m.allocate_slots(a, 3) == [3]
    assert m.get_block_ids("a") == [0, 1, 2, 3]
    assert free_ids(m) == [4, 5]
    assert m.usage == 4 / 6


def test_allocate_slots_in_chunks():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(11)))
    h0 = hash_block(None, (0, 1, 2, 3))
    h1 = hash_block(h0, (4, 5, 6, 7))
    assert m.allocate_slots(a, 3) == [0]
    compute(m, a, 3)
    assert m.block_pool.cached_blocks == {}
    assert m.allocate_slots(a, 3) == [1]  # tokens 3..5
    compute(m, a, 3)
    assert m.block_pool.cached_blocks == {h0: 0}
    assert m.allocate_slots(a, 5) == [2]  # tokens 6..10
    assert m.get_block_ids("a") == [0, 1, 2]
    compute(m, a, 5)
    assert m.block_pool.cached_blocks == {h0: 0, h1: 1}
    assert m.block_pool.block_hashes == [h0, h1, None, None, None, None]
    # Caching is idempotent.
    m.cache_blocks(a, 11)
    assert m.block_pool.cached_blocks == {h0: 0, h1: 1}


def test_allocate_slots_short_returns_none_and_allocates_nothing():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(20)))
    assert m.allocate_slots(a, 20) == [0, 1, 2, 3, 4]
    b = make_request("b", list(range(100, 108)))
    before = snapshot(m)
    assert m.allocate_slots(b, 8) is None
    assert snapshot(m) == before
    assert "b" not in m.block_tables()
    assert m.get_block_ids("b") == []
    # A running request that cannot grow keeps the blocks it has.
    compute(m, a, 20)
    before = snapshot(m)
    assert m.allocate_slots(a, 5) is None  # needs 2 more blocks, 1 free
    assert snapshot(m) == before
    assert m.allocate_slots(a, 4) == [5]
    assert m.allocate_slots(b, 1) is None
    assert m.block_pool.num_free_blocks == 0


def test_prefix_cache_hits():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    a = make_request("a", prompt)
    assert m.get_computed_blocks(a) == ([], 0)
    assert m.allocate_slots(a, 10) == [0, 1, 2]
    # Findable as soon as allocated for the step that computes them (requests
    # admitted later in the same step share them).
    assert m.get_computed_blocks(make_request("x", prompt)) == ([0, 1], 8)
    compute(m, a, 10)
    # Only the two full blocks are cached.
    assert m.block_pool.cached_blocks == {
        hash_block(None, (0, 1, 2, 3)): 0,
        hash_block(hash_block(None, (0, 1, 2, 3)), (4, 5, 6, 7)): 1,
    }
    assert m.block_pool.block_hashes[2] is None

    b = make_request("b", prompt)
    assert m.get_computed_blocks(b) == ([0, 1], 8)
    # Taking no reference: ref counts unchanged until allocate_slots.
    assert m.block_pool.ref_cnts[:3] == [1, 1, 1]
    assert m.allocate_slots(b, 2, [0, 1]) == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert m.block_pool.ref_cnts[:4] == [2, 2, 1, 1]
    assert free_ids(m) == [4, 5, 6, 7]

    # A longer prompt sharing two blocks: hits stop where the tokens differ.
    c = make_request("c", list(range(8)) + [99, 98, 97, 96, 95])
    assert m.get_computed_blocks(c) == ([0, 1], 8)
    # A shorter prompt: only full blocks before the last token count.
    d = make_request("d", list(range(5)))
    assert m.get_computed_blocks(d) == ([0], 4)
    # Lookups alone count nothing: the scheduler records admitted ones.
    assert m.prefix_cache_queries == m.prefix_cache_hits == 0


def test_at_least_one_token_is_left_to_compute():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(12)))
    m.allocate_slots(a, 12)
    compute(m, a, 12)
    assert len(m.block_pool.cached_blocks) == 3
    # The whole prompt is cached, but its last block is left to compute.
    b = make_request("b", list(range(12)))
    assert m.get_computed_blocks(b) == ([0, 1], 8)
    c = make_request("c", list(range(4)))
    assert m.get_computed_blocks(c) == ([], 0)
    e = make_request("e", list(range(13)))
    assert m.get_computed_blocks(e) == ([0, 1, 2], 12)


def test_hits_follow_the_chain():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.allocate_slots(a, 9)
    compute(m, a, 9)
    # Same second block, different first: no hit on the second either.
    b = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.get_computed_blocks(b) == ([], 0)
    # A block equal to a's first, in second place: no hit (it is chained to another parent).
    c = make_request("c", [1, 2, 3, 4, 1, 2, 3, 4, 9])
    assert m.get_computed_blocks(c) == ([0], 4)


def test_record_prefix_lookup_counts_only_with_caching():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.record_prefix_lookup(10, 8)
    m.record_prefix_lookup(5, 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (15, 8)
    off = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    off.record_prefix_lookup(10, 0)
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


def test_free_puts_tail_first_at_the_back():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(10)))
    assert m.allocate_slots(a, 10) == [0, 1, 2]
    compute(m, a, 10)
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]
    assert m.block_pool.ref_cnts == [0] * 6
    assert "a" not in m.requests
    # Eviction order: never-used blocks, then a's tail block, then its head.
    b = make_request("b", list(range(100, 120)))
    assert m.allocate_slots(b, 20) == [3, 4, 5, 2, 1]
    # Block 1 held a's second block: its hash is gone; block 0 is still findable.
    h0 = hash_block(None, (0, 1, 2, 3))
    assert m.block_pool.get_cached_block(h0) == 0
    assert m.block_pool.get_cached_block(hash_block(h0, (4, 5, 6, 7))) is None
    assert m.get_computed_blocks(make_request("c", list(range(10)))) == ([0], 4)


def test_freeing_an_unknown_request_does_nothing():
    m = KVCacheManager(num_blocks=2, block_size=BS)
    before = snapshot(m)
    m.free(make_request("x", [1, 2, 3]))
    assert snapshot(m) == before


def test_shared_blocks_stay_used_until_the_last_owner_frees():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    a = make_request("a", prompt)
    assert m.allocate_slots(a, 9) == [0, 1, 2]
    compute(m, a, 9)
    b = make_request("b", prompt)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert (hits, num_hit_tokens) == ([0, 1], 8)
    assert m.allocate_slots(b, 1, hits) == [3]
    m.free(a)
    assert m.block_pool.ref_cnts == [1, 1, 0, 1, 0, 0]
    assert free_ids(m) == [4, 5, 2]
    m.free(b)
    assert m.block_pool.ref_cnts == [0] * 6
    assert free_ids(m) == [4, 5, 2, 3, 1, 0]


def test_hits_on_freed_blocks_come_back_from_the_free_queue():
    m = KVCacheManager(num_blocks=5, block_size=BS)
    prompt = list(range(10))
    a = make_request("a", prompt)
    assert m.allocate_slots(a, 10) == [0, 1, 2]
    compute(m, a, 10)
    m.free(a)
    assert free_ids(m) == [3, 4, 2, 1, 0]
    b = make_request("b", prompt)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert (hits, num_hit_tokens) == ([0, 1], 8)
    assert m.allocate_slots(b, 2, hits) == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert m.block_pool.ref_cnts == [1, 1, 0, 1, 0]
    assert free_ids(m) == [4, 2]


def test_hits_in_the_free_queue_count_against_free_blocks():
    m = KVCacheManager(num_blocks=3, block_size=BS)
    prompt = list(range(9))
    a = make_request("a", prompt)
    assert m.allocate_slots(a, 9) == [0, 1, 2]
    compute(m, a, 9)
    m.free(a)
    assert free_ids(m) == [2, 1, 0]
    b = make_request("b", prompt + [50, 51, 52, 53])  # 13 tokens: 4 blocks
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert (hits, num_hit_tokens) == ([0, 1], 8)
    # 3 free blocks, 2 of them are the hits: 1 left, 2 needed.
    before = snapshot(m)
    assert m.allocate_slots(b, 5, hits) is None
    assert snapshot(m) == before
    assert "b" not in m.block_tables()
    # With 1 new block needed it fits exactly.
    assert m.allocate_slots(b, 4, hits) == [2]
    assert m.get_block_ids("b") == [0, 1, 2]
    assert free_ids(m) == []


def test_decoded_blocks_are_cached_when_full():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", [7, 7, 7])
    assert m.allocate_slots(a, 3) == [0]
    compute(m, a, 3)
    assert m.block_pool.cached_blocks == {}
    a.append_output_token(8)  # the token sampled from the prompt
    assert m.allocate_slots(a, 1) == []  # token 3 fills block 0, cached as it is allocated
    compute(m, a, 1)
    assert m.block_pool.cached_blocks == {hash_block(None, (7, 7, 7, 8)): 0}
    a.append_output_token(9)
    # A new request whose prompt is a's tokens so far hits the decoded block.
    b = make_request("b", [7, 7, 7, 8, 9])
    assert m.get_computed_blocks(b) == ([0], 4)


def test_caching_disabled_gives_no_hits():
    m = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    prompt = list(range(10))
    a = make_request("a", prompt)
    assert m.allocate_slots(a, 10) == [0, 1, 2]
    compute(m, a, 10)
    assert m.block_pool.cached_blocks == {}
    assert m.block_pool.block_hashes == [None] * 6
    b = make_request("b", prompt)
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.allocate_slots(b, 10) == [3, 4, 5]
    assert m.prefix_cache_queries == 0
    assert m.prefix_cache_hits == 0


# ---- sliding windows (every layer slides): blocks behind the window go back ----------


def test_blocks_behind_every_window_go_back():
    """Window 6: a query at position p reads keys p-5..p. Once the next token is at
    position 12, block 0 (positions 0-3) is behind every window: freed, its entry
    NO_BLOCK, still findable by hash until the pool hands it out."""
    from pagoda.core.kv_cache_manager import NO_BLOCK

    m = KVCacheManager(num_blocks=6, block_size=BS, sliding_window=6)
    a = make_request("a", list(range(12)))
    assert m.allocate_slots(a, 8) == [0, 1]
    compute(m, a, 8)
    assert m.allocate_slots(a, 4) == [2]  # next token at 8: keys 3.. still need block 0
    assert m.get_block_ids("a") == [0, 1, 2]
    compute(m, a, 4)
    a.append_output_token(99)
    assert m.allocate_slots(a, 1) == [3]  # at 12: keys 7..; block 0 is behind
    assert m.get_block_ids("a") == [NO_BLOCK, 1, 2, 3]
    assert m.block_pool.ref_cnts[0] == 0 and 0 in m.block_pool.cached_blocks.values()
    assert m.block_pool.num_used_blocks == 3
    m.free(a)
    assert m.block_pool.num_used_blocks == 0 and sorted(free_ids(m)) == list(range(6))


def test_window_hits_need_only_the_blocks_the_window_reaches():
    """A prompt whose first block was evicted still hits: the longest prefix whose
    blocks within the next token's window are cached; the blocks before them become
    NO_BLOCK entries, referenced by no one."""
    from pagoda.core.kv_cache_manager import NO_BLOCK

    m = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=6)
    prompt = list(range(20))
    a = make_request("a", prompt)
    assert m.allocate_slots(a, 20) == [0, 1, 2, 3, 4]
    compute(m, a, 20)
    m.free(a)
    m.block_pool.forget_hash(0)  # evicted: positions 0-3 are no longer findable
    b = make_request("b", prompt + [7, 7])
    ids, num_tokens = m.get_computed_blocks(b)
    # The next token (position 20) reads keys 15..: blocks 3 and 4 are all it needs.
    assert (ids, num_tokens) == ([NO_BLOCK, NO_BLOCK, NO_BLOCK, 3, 4], 20)
    assert m.allocate_slots(b, 2, ids) == [5]  # the free queue's front
    assert m.get_block_ids("b") == [NO_BLOCK, NO_BLOCK, NO_BLOCK, 3, 4, 5]
    assert [m.block_pool.ref_cnts[i] for i in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 1]
    m.free(b)
    assert m.block_pool.num_used_blocks == 0
    # Without a window the same lookup stops at the first miss.
    plain = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", prompt)
    plain.allocate_slots(a, 20)
    compute(plain, a, 20)
    plain.free(a)
    plain.block_pool.forget_hash(0)
    assert plain.get_computed_blocks(make_request("c", prompt + [7, 7])) == ([], 0)
