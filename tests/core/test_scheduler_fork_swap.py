"""Randomized runs of the scheduler with parallel sampling (fork + copy-on-write) and
swap preemption, against a fake runner that tracks what K/V each slot holds.

Every completion samples tokens of its own, so a shared block written in place
(a missed copy-on-write) or a swapped block brought back wrong shows up as a
request reading another's K/V.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from unittest import mock

from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig, SpeculativeConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from tests.helpers import FakeRunner

BS = 4


class DistinctRunner(FakeRunner):
    """Like FakeRunner, but completion i of a request samples 1000 * (i + 1) + k."""

    def target(self, item, j: int) -> int:
        return 1000 * (completion_index(item.request_id) + 1) + item.num_output_tokens + j


def completion_index(request_id: str) -> int:
    return int(request_id.split("#")[1]) if "#" in request_id else 0


def expected_tokens(request_id: str, max_tokens: int) -> list[int]:
    return [1000 * (completion_index(request_id) + 1) + k for k in range(max_tokens)]


def oracle_drafts(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """What DistinctRunner will sample next (each completion counts up by one), with the
    token at a place that varies with the length spoiled (or none)."""
    last = token_ids[-1]
    if last < 1000:
        return []
    drafts = [last + 1 + j for j in range(k)]
    spoil = len(token_ids) * 7 % 6
    if spoil < k:
        drafts[spoil] = 7
    return drafts


def check(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    refs = Counter(b for ids in kv.block_tables().values() for b in ids)
    assert [refs[b] for b in range(pool.num_blocks)] == pool.ref_cnts
    assert set(pool.free_queue) == {b for b in range(pool.num_blocks) if pool.ref_cnts[b] == 0}
    host = kv.host_pool
    if host is not None:
        host_tables = [r.host_block_ids for r in kv.requests.values() if r.host_block_ids]
        host_refs = Counter(b for ids in host_tables for b in ids)
        assert [host_refs[b] for b in range(host.num_blocks)] == host.ref_cnts
    # A swapped request holds no device blocks; a running one holds enough for its tokens.
    for record in kv.requests.values():
        assert record.host_block_ids is None or not record.block_ids
    for r in sched.running:
        assert len(kv.get_block_ids(r.request_id)) * BS >= r.num_computed_tokens


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(6, 24),
    num_host_blocks=st.integers(0, 24),
    budget=st.integers(4, 40),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    num_drafts=st.integers(0, 5),
)
def test_random_fork_and_swap(data, num_blocks, num_host_blocks, budget, mode, caching, num_drafts):
    """`num_drafts` > 0: speculative decoding, drafting the true continuation with one
    token spoiled at a varying place (so drafts are accepted whole, in part or not)."""
    max_model_len = num_blocks * BS
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        preemption_mode=mode,
        speculative=SpeculativeConfig.from_dict(
            {"num_speculative_tokens": num_drafts, "disable_by_batch_size": 100}
        )
        if num_drafts
        else None,
    )
    kv = KVCacheManager(
        num_blocks, BS, caching, num_host_blocks=num_host_blocks if mode == "swap" else 0
    )
    sched = Scheduler(config, kv)
    runner = DistinctRunner(sched)
    num_requests = data.draw(st.integers(1, 5))
    expected = {}
    for r in range(num_requests):
        prompt = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=max_model_len // 3))
        n = data.draw(st.integers(1, 3))
        max_tokens = data.draw(st.integers(1, max(1, max_model_len // 3)))
        params = dataclasses.replace(SamplingParams(max_tokens=max_tokens, n=n), eos_token_ids=())
        ids = [f"r{r}#{i}" for i in range(n)] if n > 1 else [f"r{r}"]
        children = [Request(cid, prompt, params, arrival_time=float(r)) for cid in ids]
        sched.add_request(children[0], fork_siblings=children[1:])
        for cid in ids:
            length = min(max_tokens, max_model_len - len(prompt))
            expected[cid] = expected_tokens(cid, length)
    got = {cid: [] for cid in expected}
    with mock.patch("pagoda.core.drafts.propose_ngram", oracle_drafts):
        for _ in range(2000):
            if not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            assert out.scheduled, "unfinished requests but nothing scheduled"
            for o in sched.update_from_output(out, runner(out)):
                got[o.request_id] += o.new_token_ids
            check(sched)
    assert not sched.has_unfinished_requests()
    if num_drafts:
        spec = sched.get_stats().spec_decoding
        event(f"drafts accepted: {spec.num_accepted_tokens > 0}, rejected: "
              f"{spec.num_accepted_tokens < spec.num_draft_tokens}")  # fmt: skip
        event(f"preempted while speculating: {sched.get_stats().num_preemptions > 0}")
    assert got == expected
    assert kv.block_pool.num_free_blocks == num_blocks
    if kv.host_pool is not None:
        assert kv.host_pool.num_free_blocks == num_host_blocks
