"""Scheduler driven by a fake model runner: no torch, no model.

The fake runner samples token `1000 + number of output tokens so far` for every
request that samples this step, so every request's outputs are known in advance
whatever the batching, chunking or preemption. It also keeps a fake KV cache
(slot -> the token prefix whose K/V would sit there), writes every scheduled
token into its slot, and checks that each request's context, read back through
its block table, is exactly its own token prefix: a wrong block id, a block
overwritten while shared, or a bad prefix-cache hit shows up there.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager, cdiv, hash_block
from pagoda.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagoda.core.scheduler import Scheduler
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from tests.helpers import FIRST_TOKEN, FakeRunner

BS = 4


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = BS,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    scheduling_policy: str = "fcfs",
    enable_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        scheduling_policy=scheduling_policy,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching))


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    priority: int = 0,
    arrival_time: float = 0.0,
    eos_token_ids: tuple[int, ...] = (),
    **params,
) -> Request:
    sampling_params = dataclasses.replace(SamplingParams(**params), eos_token_ids=eos_token_ids)
    return Request(request_id, prompt_token_ids, sampling_params, priority, arrival_time)


class Driver:
    """schedule() -> fake execute_model() -> update_from_output(), with outputs collected.

    `depth` > 1 drives the scheduler as the engine does under pipeline parallel: up to
    `depth` steps in flight, each run when scheduled (stage 0 starts it) and updated
    from its output only when the pipe is full or nothing more can be scheduled."""

    def __init__(self, scheduler: Scheduler, depth: int = 1) -> None:
        self.scheduler = scheduler
        self.runner = FakeRunner(scheduler)
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[str, int | str | None]] = {}
        self.depth = depth
        self.in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        self.collected = False  # whether the last step took a step's output
        self.max_in_flight = 0

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        self.tokens[request.request_id] = []
        return request

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        if self.depth == 1:
            out = self.scheduler.schedule()
        else:  # as the engine does: each step in flight its share of the requests
            out = self.scheduler.schedule(max(1, cdiv(len(self.scheduler.requests), self.depth)))
        if self.depth == 1:
            outputs = self.scheduler.update_from_output(out, self.runner(out))
        else:
            for item in out.scheduled:  # never in two steps in flight at once
                assert all(item.request_id not in summary_ids(o) for o, _ in self.in_flight)
            if not out.is_empty:
                self.in_flight.append((out, self.runner(out)))
                self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
            outputs = []
            self.collected = bool(self.in_flight) and (
                len(self.in_flight) == self.depth or out.is_empty
            )
            if self.collected:
                outputs = self.scheduler.update_from_output(*self.in_flight.pop(0))
        for o in outputs:
            self.tokens[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                assert o.request_id not in self.finish
                self.finish[o.request_id] = (o.finish_reason, o.stop_reason)
        return out, outputs

    def run(self, max_steps: int = 1000) -> int:
        for num_steps in range(1, max_steps + 1):
            out, _ = self.step()
            assert not out.is_empty
            if not self.scheduler.has_unfinished_requests():
                return num_steps
        raise AssertionError(f"not finished after {max_steps} steps")


def summary_ids(out: SchedulerOutput) -> set[str]:
    return {s.request_id for s in out.scheduled}


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, num computed before, num scheduled, samples) per scheduled request."""
    return [
        (s.request_id, s.num_computed_tokens, len(s.token_ids), s.sampling_params is not None)
        for s in out.scheduled
    ]


def running_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.running]


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def assert_all_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.num_free_blocks == kv.num_blocks
    assert kv.block_pool.ref_cnts == [0] * kv.num_blocks
    assert kv.block_tables() == {}
    assert scheduler.requests == {}
    assert not scheduler.has_unfinished_requests()


def num_preemptions(scheduler: Scheduler) -> int:
    return scheduler.get_stats().num_preemptions


def outputs(first: int, n: int) -> list[int]:
    return list(range(FIRST_TOKEN + first, FIRST_TOKEN + first + n))


# ---- batching ------------------------------------------------------------------


def test_mixed_prefill_and_decode_under_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=10)
    d = Driver(sched)
    a = d.add(make_request("a", list(range(6)), max_tokens=5))
    out, outs = d.step()
    assert summary(out) == [("a", 0, 6, True)]
    assert out.num_batched_tokens == 6
    assert outs[0].scheduled_time is not None  # its first scheduling, reported once
    assert outs == [
        EngineCoreOutput("a", [1000], None, None, scheduled_time=outs[0].scheduled_time)
    ]

    b = d.add(make_request("b", list(range(100, 112)), max_tokens=2))
    out, outs = d.step()
    # a decodes one token; b gets the 9 left of the budget: a chunk, nothing sampled.
    assert summary(out) == [("a", 6, 1, True), ("b", 0, 9, False)]
    assert out.scheduled[1].token_ids == list(range(100, 109))
    assert out.num_batched_tokens == 10
    assert outs[0] == EngineCoreOutput("a", [1001], None, None)
    assert (outs[1].request_id, outs[1].new_token_ids) == ("b", [])  # b's first scheduling
    assert outs[1].scheduled_time is not None and len(outs) == 2
    assert (a.num_computed_tokens, b.num_computed_tokens) == (7, 9)

    out, outs = d.step()
    assert summary(out) == [("a", 7, 1, True), ("b", 9, 3, True)]
    assert out.scheduled[1].token_ids == [109, 110, 111]
    assert out.num_batched_tokens == 4
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [1002]), ("b", [1000])]

    out, outs = d.step()
    assert summary(out) == [("a", 8, 1, True), ("b", 12, 1, True)]
    assert d.finish == {"b": ("length", None)}
    d.run()
    assert d.tokens == {"a": outputs(0, 5), "b": outputs(0, 2)}
    assert d.finish == {"a": ("length", None), "b": ("length", None)}
    assert_all_free(sched)


def test_decodes_beyond_the_budget_wait_for_the_next_step():
    sched = make_scheduler(max_num_batched_tokens=2)
    d = Driver(sched)
    for rid in "abc":
        d.add(make_request(rid, [1], max_tokens=2))
    assert summary(d.step()[0]) == [("a", 0, 1, True), ("b", 0, 1, True)]
    assert summary(d.step()[0]) == [("a", 1, 1, True), ("b", 1, 1, True)]
    assert summary(d.step()[0]) == [("c", 0, 1, True)]
    assert summary(d.step()[0]) == [("c", 1, 1, True)]
    assert not sched.has_unfinished_requests()
    assert d.tokens == {rid: outputs(0, 2) for rid in "abc"}
    assert_all_free(sched)


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(max_num_batched_tokens=4)
    d = Driver(sched)
    prompt = list(range(50, 60))
    a = d.add(make_request("a", prompt, max_tokens=2))
    progress = []
    for _ in range(4):
        out, outs = d.step()
        progress.append((summary(out), [s.token_ids for s in out.scheduled], a.num_computed_tokens))
        if len(progress) < 3:
            # The first chunk reports when the request was first scheduled; no tokens yet.
            assert [(o.new_token_ids, o.scheduled_time is not None) for o in outs] == (
                [([], True)] if len(progress) == 1 else []
            )
            assert a.output_token_ids == []
    assert progress == [
        ([("a", 0, 4, False)], [prompt[0:4]], 4),
        ([("a", 4, 4, False)], [prompt[4:8]], 8),
        ([("a", 8, 2, True)], [prompt[8:10]], 10),
        ([("a", 10, 1, True)], [[1000]], 11),
    ]
    assert d.tokens == {"a": [1000, 1001]}
    assert d.finish == {"a": ("length", None)}
    assert sched.num_prompt_tokens_computed == 10
    assert sched.num_generation_tokens == 2
    assert_all_free(sched)


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    d = Driver(sched)
    for rid in "abc":
        d.add(make_request(rid, [1, 2, 3], max_tokens=3))
    for step in range(3):
        out, _ = d.step()
        assert [s.request_id for s in out.scheduled] == ["a", "b"], step
        if step < 2:
            assert running_ids(sched) == ["a", "b"]
        assert waiting_ids(sched) == ["c"]
    assert running_ids(sched) == []
    out, _ = d.step()
    assert summary(out) == [("c", 0, 3, True)]
    d.run()
    assert d.tokens == {rid: outputs(0, 3) for rid in "abc"}
    assert_all_free(sched)


def test_finished_request_leaves_and_a_waiting_one_is_admitted_next_step():
    sched = make_scheduler(max_num_seqs=2)
    d = Driver(sched)
    d.add(make_request("a", [1, 2], max_tokens=1))
    d.add(make_request("b", [3, 4], max_tokens=3))
    d.add(make_request("c", [5, 6], max_tokens=2))
    out, outs = d.step()
    assert summary(out) == [("a", 0, 2, True), ("b", 0, 2, True)]
    assert dataclasses.replace(outs[0], scheduled_time=None) == EngineCoreOutput(
        "a", [1000], "length", None
    )
    assert running_ids(sched) == ["b"]
    assert waiting_ids(sched) == ["c"]
    assert "a" not in sched.requests
    assert "a" not in sched.kv_cache_manager.block_tables()
    out, _ = d.step()
    assert summary(out) == [("b", 2, 1, True), ("c", 0, 2, True)]
    assert running_ids(sched) == ["b", "c"]
    d.run()
    assert d.tokens == {"a": outputs(0, 1), "b": outputs(0, 3), "c": outputs(0, 2)}
    assert_all_free(sched)


# ---- stopping --------------------------------------------------------------------


def run_one(prompt_len: int = 5, max_model_len: int = 1024, **kwargs) -> tuple:
    sched = make_scheduler(max_model_len=max_model_len)
    d = Driver(sched)
    request = d.add(make_request("r", list(range(prompt_len)), **kwargs))
    d.run()
    assert_all_free(sched)
    assert d.tokens["r"] == request.output_token_ids
    reason, stop_reason = d.finish["r"]
    assert request.status.finish_reason == reason
    assert request.stop_reason == stop_reason
    return d.tokens["r"], reason, stop_reason


def test_eos_stops():
    assert run_one(eos_token_ids=(1002,), max_tokens=10) == (outputs(0, 3), "stop", None)
    # The first token can be EOS.
    assert run_one(eos_token_ids=(7, 1000), max_tokens=10) == ([1000], "stop", None)


def test_ignore_eos():
    assert run_one(eos_token_ids=(1002,), ignore_eos=True, max_tokens=5) == (
        outputs(0, 5),
        "length",
        None,
    )


def test_stop_token_ids_set_stop_reason():
    assert run_one(stop_token_ids=[1001, 1003], max_tokens=10) == (outputs(0, 2), "stop", 1001)
    # stop_token_ids apply even with ignore_eos.
    assert run_one(stop_token_ids=[1001], ignore_eos=True, max_tokens=10) == (
        outputs(0, 2),
        "stop",
        1001,
    )


def test_min_tokens_delays_eos_and_stop_tokens():
    # EOS at the 2nd token is ignored (fewer than 4); the next EOS, at the 5th, stops.
    assert run_one(eos_token_ids=(1001, 1004), min_tokens=4, max_tokens=10) == (
        outputs(0, 5),
        "stop",
        None,
    )
    # A stop at exactly min_tokens tokens counts.
    assert run_one(eos_token_ids=(1001,), min_tokens=2, max_tokens=10) == (
        outputs(0, 2),
        "stop",
        None,
    )
    assert run_one(stop_token_ids=[1001, 1005], min_tokens=3, max_tokens=10) == (
        outputs(0, 6),
        "stop",
        1005,
    )
    # min_tokens does not lift max_tokens.
    assert run_one(eos_token_ids=(1000,), min_tokens=3, max_tokens=3) == (
        outputs(0, 3),
        "length",
        None,
    )


def test_max_tokens_gives_length():
    assert run_one(max_tokens=1) == ([1000], "length", None)
    assert run_one(max_tokens=4) == (outputs(0, 4), "length", None)


def test_max_model_len_caps_the_sequence():
    # 6 prompt tokens + 3 outputs = 9 = max_model_len.
    assert run_one(prompt_len=6, max_model_len=9, max_tokens=16) == (outputs(0, 3), "length", None)
    assert run_one(prompt_len=6, max_model_len=9, max_tokens=None) == (
        outputs(0, 3),
        "length",
        None,
    )


def test_eos_wins_over_length_on_the_same_token():
    assert run_one(eos_token_ids=(1002,), max_tokens=3) == (outputs(0, 3), "stop", None)


# ---- preemption --------------------------------------------------------------------


def preemption_requests() -> list[Request]:
    return [
        make_request("a", [1, 2, 3, 4], max_tokens=3),
        make_request("b", [11, 12], max_tokens=3),
        make_request("c", [21, 22], max_tokens=3),
        make_request("d", [31, 32], max_tokens=1),
    ]


def test_preemption_of_the_most_recently_admitted():
    sched = make_scheduler(num_blocks=3)
    d = Driver(sched)
    a, b, c, dd = (d.add(r) for r in preemption_requests())
    kv = sched.kv_cache_manager

    out, _ = d.step()
    assert summary(out) == [("a", 0, 4, True), ("b", 0, 2, True), ("c", 0, 2, True)]
    assert kv.block_tables() == {"a": [0], "b": [1], "c": [2]}
    assert waiting_ids(sched) == ["d"]  # no block left for d

    # a's 5th token needs a block: c, the most recently admitted, gives up its own.
    out, _ = d.step()
    assert summary(out) == [("a", 4, 1, True), ("b", 2, 1, True)]
    assert out.preempted_request_ids == ["c"]
    assert kv.block_tables() == {"a": [0, 2], "b": [1]}
    assert running_ids(sched) == ["a", "b"]
    assert waiting_ids(sched) == ["c", "d"]  # c at the front
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == [1000]
    assert (c.num_preemptions, num_preemptions(sched)) == (1, 1)
    assert (a.num_preemptions, b.num_preemptions) == (0, 0)

    # c does not fit yet; a and b finish.
    out, _ = d.step()
    assert summary(out) == [("a", 5, 1, True), ("b", 3, 1, True)]
    assert out.preempted_request_ids == []
    assert waiting_ids(sched) == ["c", "d"]
    assert list(kv.block_pool.free_queue) == [2, 0, 1]

    # c recomputes its prompt and its first output, then samples its second.
    out, _ = d.step()
    assert summary(out) == [("c", 0, 3, True), ("d", 0, 2, True)]
    assert out.scheduled[0].token_ids == [21, 22, 1000]
    assert out.scheduled[0].block_ids == [2]
    assert out.scheduled[0].num_output_tokens == 1
    d.run()
    assert dd.output_token_ids == [1000]
    assert_all_free(sched)

    # Exactly the tokens of a run that never preempts.
    big = make_scheduler(num_blocks=64)
    ref = Driver(big)
    for r in preemption_requests():
        ref.add(r)
    ref.run()
    assert num_preemptions(big) == 0
    assert d.tokens == ref.tokens
    assert d.finish == ref.finish
    assert d.tokens == {"a": outputs(0, 3), "b": outputs(0, 3), "c": outputs(0, 3), "d": [1000]}


def test_a_request_that_cannot_grow_and_is_last_preempts_itself():
    sched = make_scheduler(num_blocks=2)
    d = Driver(sched)
    d.add(make_request("a", [1, 2], max_tokens=3))
    b = d.add(make_request("b", [3, 4, 5, 6], max_tokens=2))
    assert summary(d.step()[0]) == [("a", 0, 2, True), ("b", 0, 4, True)]
    out, _ = d.step()
    assert summary(out) == [("a", 2, 1, True)]
    assert out.preempted_request_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED
    assert sched.kv_cache_manager.block_tables() == {"a": [0]}
    d.run()
    assert d.tokens == {"a": outputs(0, 3), "b": outputs(0, 2)}
    assert num_preemptions(sched) == 1
    assert_all_free(sched)


def test_preempted_request_gets_prefix_hits_on_its_own_blocks():
    sched = make_scheduler(num_blocks=3, enable_caching=True)
    kv = sched.kv_cache_manager
    d = Driver(sched)
    d.add(make_request("a", [1, 2, 3], max_tokens=3))
    b = d.add(make_request("b", [5, 6, 7, 8, 9], max_tokens=3))
    assert summary(d.step()[0]) == [("a", 0, 3, True), ("b", 0, 5, True)]
    assert kv.block_tables() == {"a": [0], "b": [1, 2]}
    assert summary(d.step()[0]) == [("a", 3, 1, True), ("b", 5, 1, True)]
    # a's 5th token needs a block: b goes; its tail block 2 is evicted first.
    out, _ = d.step()
    assert out.preempted_request_ids == ["b"]
    assert summary(out) == [("a", 4, 1, True)]
    assert d.finish == {"a": ("length", None)}
    assert list(kv.block_pool.free_queue) == [1, 2, 0]
    hits_before = kv.prefix_cache_hits
    # b comes back, finds its full first block (still cached) and recomputes the rest.
    out, _ = d.step()
    assert summary(out) == [("b", 4, 3, True)]
    assert out.scheduled[0].token_ids == [9, 1000, 1001]
    assert out.scheduled[0].block_ids == [1, 2]
    assert kv.prefix_cache_hits - hits_before == 4
    assert b.num_preemptions == 1
    assert d.tokens == {"a": outputs(0, 3), "b": outputs(0, 3)}
    assert_all_free(sched)


# ---- priority ----------------------------------------------------------------------


def test_priority_lower_value_runs_first():
    sched = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    d = Driver(sched)
    d.add(make_request("low", [1], priority=5, arrival_time=0.0, max_tokens=2))
    d.add(make_request("high", [2], priority=0, arrival_time=1.0, max_tokens=2))
    d.add(make_request("high_later", [3], priority=0, arrival_time=2.0, max_tokens=1))
    order = [[s.request_id for s in d.step()[0].scheduled] for _ in range(5)]
    assert order == [["high"], ["high"], ["high_later"], ["low"], ["low"]]
    assert not sched.has_unfinished_requests()
    assert_all_free(sched)


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=1, scheduling_policy="fcfs")
    d = Driver(sched)
    d.add(make_request("low", [1], priority=5, arrival_time=0.0, max_tokens=1))
    d.add(make_request("high", [2], priority=0, arrival_time=1.0, max_tokens=1))
    assert [s.request_id for s in d.step()[0].scheduled] == ["low"]
    assert [s.request_id for s in d.step()[0].scheduled] == ["high"]


def test_priority_victim_is_the_highest_priority_value():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=10, scheduling_policy="priority")
    kv = sched.kv_cache_manager
    d = Driver(sched)
    a = d.add(make_request("a", [1], priority=0, arrival_time=0.0, max_tokens=10))
    b = d.add(make_request("b", [11], priority=5, arrival_time=1.0, max_tokens=10))
    assert summary(d.step()[0]) == [("a", 0, 1, True), ("b", 0, 1, True)]
    # c (priority 1) arrives after b (priority 5) was admitted.
    c = d.add(make_request("c", list(range(100, 123)), priority=1, arrival_time=2.0, max_tokens=2))
    out, _ = d.step()
    assert out.preempted_request_ids == []
    assert summary(out) == [("a", 1, 1, True), ("b", 1, 1, True), ("c", 0, 8, False)]
    # Running requests are served most important first: c's chunk takes the budget before b.
    assert summary(d.step()[0]) == [("a", 2, 1, True), ("c", 8, 9, False)]
    assert summary(d.step()[0]) == [("a", 3, 1, True), ("c", 17, 6, True), ("b", 2, 1, True)]
    assert kv.block_tables() == {"a": [0], "b": [1], "c": [2, 3, 4, 5, 6, 7]}
    assert kv.block_pool.num_free_blocks == 0
    # a's 5th token needs a block: fcfs would take the newest, priority takes b.
    out, _ = d.step()
    assert out.preempted_request_ids == ["b"]
    assert summary(out) == [("a", 4, 1, True), ("c", 23, 1, True)]
    assert kv.block_tables() == {"a": [0, 1]}  # c finished (2 tokens)
    assert (a.status, b.status, c.status) == (
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
        RequestStatus.FINISHED_LENGTH,
    )
    d.run()
    assert d.tokens == {"a": outputs(0, 10), "b": outputs(0, 10), "c": outputs(0, 2)}
    assert num_preemptions(sched) == 1
    assert_all_free(sched)


def test_priority_waiting_request_preempts_a_lower_priority_running_one():
    sched = make_scheduler(num_blocks=3, max_model_len=12, scheduling_policy="priority")
    d = Driver(sched)
    low = d.add(make_request("low", list(range(8)), priority=5, arrival_time=0.0, max_tokens=2))
    assert summary(d.step()[0]) == [("low", 0, 8, True)]
    # One block free: enough for high's prompt, but not for high plus low's next token.
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 1
    d.add(make_request("high", [21, 22], priority=0, arrival_time=1.0, max_tokens=2))
    out, _ = d.step()
    assert out.preempted_request_ids == ["low"]
    assert summary(out) == [("high", 0, 2, True)]
    assert waiting_ids(sched) == ["low"]
    assert low.status == RequestStatus.PREEMPTED
    d.run()
    assert d.tokens == {"low": outputs(0, 2), "high": outputs(0, 2)}
    assert num_preemptions(sched) == 1
    assert_all_free(sched)


def test_priority_equal_or_better_running_requests_are_not_preempted_for_waiting():
    sched = make_scheduler(num_blocks=2, max_model_len=8, scheduling_policy="priority")
    d = Driver(sched)
    d.add(make_request("first", list(range(6)), priority=1, arrival_time=0.0, max_tokens=2))
    d.step()
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 0
    d.add(make_request("same", [21, 22], priority=1, arrival_time=1.0, max_tokens=2))
    out, _ = d.step()
    assert out.preempted_request_ids == []
    assert summary(out) == [("first", 6, 1, True)]
    assert waiting_ids(sched) == ["same"]
    d.run()
    assert num_preemptions(sched) == 0
    assert_all_free(sched)


def test_priority_running_loop_never_preempts_the_more_important_request():
    sched = make_scheduler(num_blocks=3, scheduling_policy="priority")
    d = Driver(sched)
    d.add(make_request("low", [1, 2, 3, 4], priority=5, arrival_time=0.0, max_tokens=8))
    d.step()  # low: block 0
    d.add(make_request("high", [11, 12, 13, 14], priority=0, arrival_time=1.0, max_tokens=8))
    out, _ = d.step()  # low's 5th token: block 1; high: block 2; nothing free
    assert out.preempted_request_ids == []
    assert running_ids(sched) == ["low", "high"]
    # high's 5th token needs a block; low (priority 5) must be the victim, not high.
    out, _ = d.step()
    assert out.preempted_request_ids == ["low"]
    assert running_ids(sched) == ["high"]


def test_priority_a_request_is_not_preempted_and_readmitted_in_one_step():
    sched = make_scheduler(num_blocks=3, scheduling_policy="priority")
    d = Driver(sched)
    d.add(make_request("a", [1, 2, 3], priority=0, arrival_time=0.0, max_tokens=5))
    d.add(make_request("b", [11, 12], priority=5, arrival_time=1.0, max_tokens=3))
    d.step()  # a: block 0, b: block 1; 1 block free
    d.add(make_request("c", [21, 22], priority=1, arrival_time=2.0, max_tokens=3))
    out, _ = d.step()
    preempted = set(out.preempted_request_ids)
    assert not preempted & {s.request_id for s in out.scheduled}
    # c fits in the free block and neither a nor b needs a new one this step.
    assert out.preempted_request_ids == []
    assert summary(out) == [("a", 3, 1, True), ("b", 2, 1, True), ("c", 0, 2, True)]


# ---- aborts -------------------------------------------------------------------------


def test_finish_requests_of_running_and_waiting():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    d = Driver(sched)
    a = d.add(make_request("a", list(range(6)), max_tokens=8))
    b = d.add(make_request("b", [1, 2], max_tokens=8))
    d.step()
    assert running_ids(sched) == ["a"]
    assert waiting_ids(sched) == ["b"]
    assert sched.kv_cache_manager.block_tables() == {"a": [0, 1]}
    finished = sched.finish_requests(["nope", "a", "b"], RequestStatus.FINISHED_ABORTED)
    assert finished == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert_all_free(sched)
    assert list(sched.kv_cache_manager.block_pool.free_queue) == [2, 3, 4, 5, 6, 7, 1, 0]
    # Aborting again, or an unknown id, does nothing.
    assert sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED) == []
    assert sched.schedule().is_empty


def test_abort_mid_prefill_and_of_a_preempted_request():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=64)
    d = Driver(sched)
    d.add(make_request("a", [1, 2, 3, 4], max_tokens=3))
    d.add(make_request("b", [11, 12], max_tokens=3))
    c = d.add(make_request("c", [21, 22], max_tokens=3))
    d.step()
    out, _ = d.step()
    assert out.preempted_request_ids == ["c"]
    assert sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED) == [c]
    assert waiting_ids(sched) == []
    assert "c" not in sched.requests
    d.run()
    assert d.tokens == {"a": outputs(0, 3), "b": outputs(0, 3), "c": [1000]}
    assert "c" not in d.finish
    assert_all_free(sched)

    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    d = Driver(sched)
    x = d.add(make_request("x", list(range(10)), max_tokens=2))
    d.add(make_request("y", [7], max_tokens=2))
    assert summary(d.step()[0]) == [("x", 0, 4, False)]
    assert summary(d.step()[0]) == [("x", 4, 4, False)]
    assert sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED) == [x]
    assert x.output_token_ids == []
    assert summary(d.step()[0]) == [("y", 0, 1, True)]
    d.run()
    assert d.tokens == {"x": [], "y": outputs(0, 2)}
    assert_all_free(sched)


def test_stats():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    d = Driver(sched)
    d.add(make_request("a", list(range(9)), max_tokens=2))
    d.run()
    d.add(make_request("b", list(range(9)), max_tokens=2))
    out, _ = d.step()
    assert summary(out) == [("b", 8, 1, True)]  # 8 tokens from the prefix cache
    d.run()
    stats = sched.get_stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)
    assert (stats.num_preemptions, stats.num_prompt_tokens, stats.num_generation_tokens) == (
        0,
        9 + 1,
        4,
    )
    kv = stats.kv_cache
    assert (kv.num_blocks_total, kv.num_blocks_used, kv.usage_perc) == (8, 0, 0.0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 8)
    assert kv.prefix_cache_hit_rate == 8 / 18


# ---- randomized ---------------------------------------------------------------------


def expected_outputs(prompt_len: int, params: SamplingParams, max_model_len: int):
    """The slow, obvious twin of the stop rules, for the fake runner's token stream."""
    out: list[int] = []
    while True:
        token = FIRST_TOKEN + len(out)
        out.append(token)
        if len(out) >= params.min_tokens:
            if not params.ignore_eos and token in params.eos_token_ids:
                return out, "stop", None
            if token in params.stop_token_ids:
                return out, "stop", token
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out, "length", None
        if prompt_len + len(out) >= max_model_len:
            return out, "length", None


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int) -> list[int]:
    hashes: list[int] = []
    for i in range(num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
    return hashes


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    bs = kv.block_size
    n = pool.num_blocks
    assert pool.num_free_blocks + pool.num_used_blocks == n
    assert min(pool.ref_cnts) >= 0
    free = list(pool.free_queue)
    assert len(set(free)) == len(free)
    # Free exactly when unreferenced: none both free and referenced, none lost.
    assert set(free) == {b for b in range(n) if pool.ref_cnts[b] == 0}
    for ids in kv.block_tables().values():
        assert len(set(ids)) == len(ids)
    refs = Counter(b for ids in kv.block_tables().values() for b in ids)
    assert [refs[b] for b in range(n)] == pool.ref_cnts
    for b, count in refs.items():
        if count > 1:
            assert pool.block_hashes[b] is not None, f"block {b} shared but not cached"
    for block_hash, b in pool.cached_blocks.items():
        assert pool.block_hashes[b] == block_hash
    if not kv.enable_caching:
        assert pool.cached_blocks == {}
        assert set(pool.block_hashes) == {None}

    running = {r.request_id: r for r in sched.running}
    waiting = {r.request_id: r for r in sched.waiting}
    assert len(running) == len(sched.running)
    assert len(waiting) == len(sched.waiting)
    assert not running.keys() & waiting.keys()
    assert set(sched.requests) == running.keys() | waiting.keys()
    assert len(running) <= sched.config.max_num_seqs
    assert set(kv.block_tables()) == running.keys()
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        # A request whose step is in flight may not have computed anything yet.
        in_flight = r.request_id in sched.in_flight
        assert (0 if in_flight else 1) <= r.num_computed_tokens < r.num_tokens
        block_ids = kv.get_block_ids(r.request_id)
        assert cdiv(r.num_computed_tokens, bs) <= len(block_ids) <= cdiv(r.num_tokens, bs)
        # A block with a hash holds computed tokens (or ones its step in flight
        # computes), and exactly this request's prefix.
        computed = r.num_tokens if in_flight else r.num_computed_tokens
        hashes = chain_hashes(r.all_token_ids, bs, computed // bs)
        for i, b in enumerate(block_ids):
            if pool.block_hashes[b] is not None:
                assert i < len(hashes)
                assert pool.block_hashes[b] == hashes[i]
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    assert num_preemptions(sched) >= sum(r.num_preemptions for r in sched.requests.values())


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(2, 32))
    min_num_blocks = cdiv(max_model_len, block_size)  # any single request fits alone
    config = dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=draw(st.integers(min_num_blocks, min_num_blocks + 2)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
        max_num_seqs=draw(st.sampled_from([1, 2, 3, 4, 8])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_caching=draw(st.booleans()),
    )
    # Prompts start with a prefix of one of two shared sequences, so prefixes repeat.
    token = st.integers(0, 1)
    bases = draw(
        st.lists(
            st.lists(token, min_size=max_model_len, max_size=max_model_len), min_size=2, max_size=2
        )
    )
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prompt_len = draw(st.integers(1, max_model_len - 1))
        num_shared = draw(st.just(prompt_len) | st.integers(0, prompt_len))
        tail = draw(
            st.lists(token, min_size=prompt_len - num_shared, max_size=prompt_len - num_shared)
        )
        max_tokens = draw(st.integers(1, 12))
        requests.append(
            dict(
                prompt=draw(st.sampled_from(bases))[:num_shared] + tail,
                arrival_step=draw(st.integers(0, 3)),
                abort_step=draw(st.none() | st.none() | st.integers(0, 30)),
                priority=draw(st.integers(0, 2)),
                params=dict(
                    max_tokens=max_tokens,
                    min_tokens=draw(st.integers(0, max_tokens)),
                    ignore_eos=draw(st.booleans()),
                    stop_token_ids=draw(st.lists(st.sampled_from([1001, 1002, 1004]), max_size=2)),
                    eos_token_ids=draw(st.sampled_from([(), (1000,), (1003,), (1006,)])),
                ),
                request_id=f"r{i}",
            )
        )
    return config, requests


MAX_STEPS = 2000


@pytest.mark.parametrize("depth", [1, 2])
@settings(max_examples=50, deadline=None)
@given(scenarios())
def test_random_workloads_keep_invariants(depth, scenario):
    """depth 2: two steps in flight (pipeline parallel), the same outputs."""
    config, specs = scenario
    sched = make_scheduler(**config)
    d = Driver(sched, depth)
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    for step in range(MAX_STEPS):
        for spec in specs:
            if spec["arrival_step"] == step:
                rid = spec["request_id"]
                requests[rid] = d.add(
                    make_request(
                        rid,
                        spec["prompt"],
                        priority=spec["priority"],
                        arrival_time=float(int(rid[1:])),
                        **spec["params"],
                    )
                )
        to_abort = [
            s["request_id"]
            for s in specs
            if s["abort_step"] == step and s["request_id"] in sched.requests
        ]
        if to_abort:
            finished = sched.finish_requests(to_abort + ["unknown"], RequestStatus.FINISHED_ABORTED)
            assert [r.request_id for r in finished] == to_abort
            aborted.update(to_abort)
            check_invariants(sched)
        if len(requests) == len(specs) and not sched.has_unfinished_requests():
            break
        if sched.has_unfinished_requests():
            out, _ = d.step()
            # Liveness: any one request fits the pool alone, so each step does work.
            assert not out.is_empty or d.collected
        check_invariants(sched)
    else:
        raise AssertionError(f"not done after {MAX_STEPS} steps")

    event(f"preempted: {num_preemptions(sched) > 0}")
    if config["enable_caching"]:
        event(f"prefix hits: {sched.kv_cache_manager.prefix_cache_hits > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"steps in flight at once: {d.max_in_flight}")
    event(f"chunked: {any(len(s['prompt']) > config['max_num_batched_tokens'] for s in specs)}")
    assert_all_free(sched)
    assert not sched.waiting
    assert sched.running == []
    for spec in specs:
        rid = spec["request_id"]
        request = requests[rid]
        tokens, reason, stop_reason = expected_outputs(
            len(spec["prompt"]), request.sampling_params, config["max_model_len"]
        )
        assert d.tokens[rid] == request.output_token_ids
        if rid in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert tokens[: len(d.tokens[rid])] == d.tokens[rid]
            assert rid not in d.finish
        else:
            assert d.tokens[rid] == tokens
            assert d.finish[rid] == (reason, stop_reason)
            assert request.stop_reason == stop_reason


def test_priority_queue_membership_and_removal():
    from pagoda.core.request_queue import PriorityQueue

    queue = PriorityQueue()
    reqs = [make_request(str(i), [1, 2], priority=i % 3, arrival_time=float(i)) for i in range(9)]
    for r in reqs:
        queue.add(r)
    assert all(r in queue for r in reqs) and make_request("x", [1]) not in queue
    queue.remove(reqs[4])
    assert reqs[4] not in queue and len(queue) == 8
    assert [r.request_id for r in queue] == ["0", "3", "6", "1", "7", "2", "5", "8"]
