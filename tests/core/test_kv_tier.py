"""The disk tier (pagoda/core/kv_tier.py) alone: what is written is read back after a
restart; a damaged, truncated or foreign file is a miss and is removed; the byte
budget drops the least recently used; two tiers share a directory. Then under the
scheduler, with a fake runner that checks every K/V it reads."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_tier import HEADER_BYTES, KVTier, fingerprint
from pagoda.core.scheduler import Scheduler
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from tests.helpers import FIRST_TOKEN, FakeRunner

FP = fingerprint("model", "bfloat16", 16)


def block(i: int, size: int = 1000) -> tuple[bytes, bytes]:
    """(a block hash, its payload)."""
    return i.to_bytes(16, "little"), bytes((i * 7 + j) % 251 for j in range(size))


def read_blocks(block_ids: list[int]) -> list[bytes]:
    """The runner's part: block i holds block(i)'s payload."""
    return [block(i)[1] for i in block_ids]


def tier_at(tmp_path, max_bytes: int = 1 << 30, fp: bytes = FP) -> KVTier:
    return KVTier(str(tmp_path), max_bytes, fp, read_blocks)


def save(tier: KVTier, i: int) -> bool:
    return tier.save(block(i)[0], i)


def written(tmp_path, n: int, max_bytes: int = 1 << 30) -> KVTier:
    tier = tier_at(tmp_path, max_bytes)
    assert all(save(tier, i) for i in range(n))
    tier.flush()
    assert sorted(tier.take_saved()) == list(range(n))  # each copied, so given back
    return tier


def files(tier: KVTier) -> list[str]:
    return sorted(os.listdir(tier.folder))


def test_a_block_copied_out_is_found_before_its_file_is_written(tmp_path, monkeypatch):
    """Once the writer has copied a block, its memory block is given back; a lookup
    between then and the file landing is served from the writer's copy."""
    import threading

    tier = tier_at(tmp_path)
    may_write, write = threading.Event(), tier._write
    monkeypatch.setattr(tier, "_write", lambda h, p: may_write.wait() and write(h, p))
    try:
        assert save(tier, 4)
        tier.wait_copied()
        assert tier.take_saved() == [4] and files(tier) == []  # given back, not on disk
        assert tier.stage([block(4)[0]]) == 1 and bytes(tier.take(block(4)[0])) == block(4)[1]
    finally:
        may_write.set()
    tier.flush()
    assert len(files(tier)) == 1 and tier.stage([block(4)[0]]) == 1
    tier.close()


def test_blocks_outlive_the_tier(tmp_path):
    tier = written(tmp_path, 3)
    assert len(files(tier)) == 3 and all(f.endswith(".kv") for f in files(tier))  # no .tmp left
    tier.close()
    again = tier_at(tmp_path)  # a restart: the index comes from the folder
    assert len(again) == 3
    hashes = [block(i)[0] for i in range(3)]
    assert again.stage(hashes) == 3
    assert [again.take(h) for h in hashes] == [block(i)[1] for i in range(3)]
    assert again.stats.hits == 3 and again.stats.bytes_read > 3000
    again.close()


def test_stage_stops_at_the_first_missing_block(tmp_path):
    tier = written(tmp_path, 4)
    hashes = [block(i)[0] for i in (0, 1, 9, 2)]
    assert tier.stage(hashes) == 2
    assert tier.holds(block(3)[0]) and not tier.holds(block(9)[0])
    tier.close()


def test_damaged_truncated_and_foreign_files_are_misses_and_go(tmp_path):
    tier = written(tmp_path, 3)
    paths = [os.path.join(tier.folder, f) for f in files(tier)]
    with open(paths[0], "r+b") as f:  # a flipped byte in the payload
        f.seek(200)
        f.write(b"\xff")
    with open(paths[1], "r+b") as f:  # cut short
        f.truncate(300)
    other = tier_at(tmp_path, fp=fingerprint("another model"))
    save(other, 5)
    other.flush()
    # another model's block under this model's name: its header names its own model
    os.replace(os.path.join(other.folder, files(other)[0]), os.path.join(tier.folder, block(5)[0].hex() + ".kv"))  # fmt: skip
    for path_hash in (bytes.fromhex(os.path.basename(p)[:-3]) for p in paths[:2]):
        assert tier.stage([path_hash]) == 0
    assert tier.stage([block(5)[0]]) == 0
    remaining = files(tier)
    assert len(remaining) == 1 and tier.stage([bytes.fromhex(remaining[0][:-3])]) == 1
    assert tier.stats.blocks_removed == 3
    tier.close()
    other.close()


def test_the_budget_drops_the_least_recently_used(tmp_path):
    size = len(block(0)[1]) + HEADER_BYTES  # payload and header
    tier = written(tmp_path, 3, max_bytes=3 * size)
    assert tier.stage([block(0)[0]]) == 1  # block 0 read: now the most recent
    save(tier, 3)
    tier.flush()
    assert not tier.holds(block(1)[0]) and tier.holds(block(0)[0]) and tier.holds(block(3)[0])
    assert len(files(tier)) == 3
    tier.close()
    smaller = tier_at(tmp_path, 2 * size)  # restarted with less room: oldest go
    assert len(smaller) == 2 and len(files(smaller)) == 2
    smaller.close()


def test_two_tiers_share_a_directory(tmp_path):
    a, b = tier_at(tmp_path), tier_at(tmp_path)
    save(a, 1)
    a.flush()
    assert b.stage([block(1)[0]]) == 1  # written by the other server, found on the miss
    assert not save(b, 1)  # already here: not written again
    assert b.stats.bytes_written == 0 and b.take_saved() == []
    a.close()
    b.close()


def test_a_failed_copy_still_gives_the_blocks_back(tmp_path):
    """A block the writer could not copy (or write) is not kept, and its holder still
    gets it back: nothing leaks."""

    def broken(block_ids):
        raise RuntimeError("the cache is gone")

    tier = KVTier(str(tmp_path), 1 << 30, FP, broken)
    assert save(tier, 1) and save(tier, 2)
    tier.flush()
    assert sorted(tier.take_saved()) == [1, 2] and len(tier) == 0 and files(tier) == []
    assert save(tier, 1)  # not held: may be tried again
    tier.close()


# ---- the scheduler with a tier, under the fake runner ----------------------------------------


BS = 4


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_blocks=st.integers(8, 20), budget=st.integers(4, 24))
def test_random_runs_through_the_tier_and_a_restart(data, num_blocks, budget):
    """Requests sharing prefixes, in a pool too small to keep them all, then the same
    again after a restart on the tier's directory: every K/V read is the right one
    (the fake runner checks each slot's prefix, those loaded from the tier too), the
    tokens are right, the tier is hit, and every block comes back to the pool."""
    max_model_len = num_blocks * BS
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len
    )
    base = data.draw(st.lists(st.integers(1, 3), min_size=BS, max_size=max_model_len // 2))
    requests = []
    for _ in range(data.draw(st.integers(1, 5))):
        cut = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=BS * 2))
        prompt = (base[:cut] + tail)[: max_model_len // 2]
        max_tokens = data.draw(st.integers(1, max_model_len // 3))
        requests.append((prompt, max_tokens))
    total_hits = 0
    with tempfile.TemporaryDirectory() as folder:
        for run in range(2):  # the second: a restart, with an empty pool
            tier = KVTier(folder, 1 << 30, FP, read_blocks)  # (the runner's, set below)
            kv = KVCacheManager(num_blocks, BS, tier=tier)
            sched = Scheduler(config, kv)
            runner = FakeRunner(sched)
            tier.read_blocks = runner.read_blocks
            got, expected = {}, {}
            for i, (prompt, max_tokens) in enumerate(requests):
                params = dataclasses.replace(
                    SamplingParams(max_tokens=max_tokens), eos_token_ids=()
                )
                sched.add_request(Request(f"r{i}", prompt, params, arrival_time=float(i)))
                got[f"r{i}"] = []
                expected[f"r{i}"] = [FIRST_TOKEN + k for k in range(max_tokens)]
            for _ in range(2000):
                if not sched.has_unfinished_requests():
                    break
                out = sched.schedule()
                assert out.scheduled, "unfinished requests but nothing scheduled"
                for o in sched.update_from_output(out, runner(out)):
                    got[o.request_id] += o.new_token_ids
                tier.flush()  # (copied before the next step: the same run every time)
            assert got == expected
            tier.close()
            kv.release_saved()
            assert kv.block_pool.num_free_blocks == num_blocks  # none held for the writer
            total_hits += kv.tier_hits
            if run == 1 and len(requests[0][0]) > BS:  # (the first admitted: nothing in memory)
                assert kv.tier_hits > 0  # the restart found what the first run computed
    event(f"tier hits: {total_hits > 0}")


def test_room_held_for_the_writer_is_waited_for_not_preempted_for(tmp_path):
    """A pool of two blocks, both held while a slow writer copies them: the next
    request's allocation waits for the copy rather than fail."""
    copying = []

    def slow_read(block_ids):
        copying.append(block_ids)
        time.sleep(0.2)
        return [b"k" * 8 for _ in block_ids]

    tier = KVTier(str(tmp_path), 1 << 30, FP, slow_read)
    kv = KVCacheManager(2, BS, tier=tier)
    params = SamplingParams(max_tokens=1)
    first = Request("a", list(range(1, 9)), params)
    assert kv.allocate_slots(first, 8) is not None
    first.num_computed_tokens = 8  # two full blocks computed
    kv.free(first)
    assert kv.block_pool.num_free_blocks == 0 and tier.num_copying == 2
    second = Request("b", [7] * 8, params)
    assert kv.allocate_slots(second, 8) is not None  # after the copy: no preemption
    assert sorted(sum(copying, [])) == [0, 1] and tier.num_copying == 0
    tier.close()


def test_a_hit_on_blocks_the_writer_held_is_counted_before_they_are_given_back(tmp_path):
    """A prefix hit on a finished request's blocks, still held for the writer (copied,
    not yet given back), in a short pool: the allocation is refused cleanly (None),
    not taken past the pool's end, and succeeds once there is room."""
    tier = KVTier(str(tmp_path), 1 << 30, FP, lambda ids: [b"k" * 8 for _ in ids])
    kv = KVCacheManager(6, BS, tier=tier)
    params = SamplingParams(max_tokens=1)
    first = Request("a", list(range(1, 9)), params)  # two full blocks
    assert kv.allocate_slots(first, 8) is not None
    first.num_computed_tokens = 8
    kv.free(first)  # both held for the writer
    filler = Request("f", [50] * 8, params)
    assert kv.allocate_slots(filler, 8) is not None
    tier.wait_copied()  # copied, not yet given back
    second = Request("b", list(range(1, 9)) + [99] * 9, params)  # a's blocks, then 3 more
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert kv.allocate_slots(second, 17 - num_hit_tokens, hits) is None  # 5 needed, 4 free
    filler.num_computed_tokens = 8
    kv.free(filler)
    tier.wait_copied()
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert kv.allocate_slots(second, 17 - num_hit_tokens, hits) is not None
    tier.close()
