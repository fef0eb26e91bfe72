"""Serving to a deadline (core/deadlines.py): the step cost the engine measures, the
waiting queue's slack order and admission, on the scheduler with a fake clock and the
fake runner. No torch, no model."""

from __future__ import annotations

import pytest

from pagoda.config import SchedulerConfig
from pagoda.core.deadlines import Deadlines, StepCost
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request_queue import FCFSQueue, PriorityQueue, SlackQueue
from pagoda.core.scheduler import Scheduler
from pagoda.core.step_shape import StepShape
from pagoda.errors import DeadlineUnmeetableError
from pagoda.request import SLO, Request
from pagoda.sampling_params import SamplingParams
from tests.helpers import FakeRunner

NOW = 1000.0  # the fake clock's time
BUDGET = 64  # max_num_batched_tokens
BASE, PER_ROW, PER_TOKEN = 0.010, 0.001, 0.001  # the fake machine's step cost (seconds)


def make_scheduler(
    policy: str = "fcfs", slo: SLO | None = None, max_num_seqs: int = 64, learned: bool = True
) -> Scheduler:
    """A scheduler whose server targets are `slo`, its clock stopped at NOW, and (with
    `learned`) its step cost taught the fake machine's by measured steps."""
    slo = slo or SLO()
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=BUDGET,
        max_model_len=1024,
        scheduling_policy=policy,
        slo_ttft_ms=slo.ttft_ms,
        slo_tpot_ms=slo.tpot_ms,
    )
    sched = Scheduler(config, KVCacheManager(1024, 4, True))
    sched.deadlines.clock = lambda: NOW
    sched.deadlines.MARGIN = 1.0  # the estimates exactly (test_the_margin has it)
    if learned:
        teach(sched.deadlines.cost)
    return sched


def teach(cost: StepCost) -> None:
    for rows in (1, 4, 8, 16, 32) * 10:
        cost.record(0, rows, BASE + PER_ROW * rows)
    cost.record(100, 0, BASE + PER_TOKEN * 100)


def request(
    request_id: str,
    num_prompt: int = 8,
    arrival: float = NOW,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    priority: int = 0,
    max_tokens: int = 4,
) -> Request:
    """(Its targets as the front door would leave them: the server's are not filled in.)"""
    slo = SLO(ttft_ms, tpot_ms) if ttft_ms or tpot_ms else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [1 + (hash(request_id) + i) % 500 for i in range(num_prompt)]
    return Request(request_id, prompt, params, priority, arrival, slo=slo)


def step(sched: Scheduler, runner: FakeRunner) -> list[str]:
    out = sched.schedule()
    sched.update_from_output(out, runner(out))
    return [item.request_id for item in out.scheduled]


def waiting_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.waiting]


# ---- the step cost ---------------------------------------------------------------------


def test_step_cost_learns_the_base_rows_and_prefill_tokens():
    cost = StepCost()
    teach(cost)
    assert cost.base == pytest.approx(BASE, rel=0.05)
    assert cost.per_decode_row == pytest.approx(PER_ROW, rel=0.05)
    assert cost.per_prefill_token == pytest.approx(PER_TOKEN, rel=0.05)
    # Prefilling 200 tokens beside 4 decodes, 60 tokens a step: 4 steps.
    expected = 4 * (BASE + 4 * PER_ROW) + 200 * PER_TOKEN
    assert cost.prefill_seconds(200, 4, 64) == pytest.approx(expected, rel=0.05)


def test_step_cost_keeps_the_row_price_at_zero_until_sizes_differ():
    """Decode steps of one size say nothing of the price of a row: all of it is base
    (a price per row would make a batch of 32 cost 32 steps)."""
    cost = StepCost()
    for _ in range(20):
        cost.record(0, 1, 0.02)
    assert (cost.base, cost.per_decode_row) == (pytest.approx(0.02), 0.0)
    assert cost.decode_seconds(32) == pytest.approx(0.02)


def test_a_slow_first_prefill_weighs_only_its_share():
    cost = StepCost()
    cost.record(100, 0, 1.0)  # cold caches: 10x
    for _ in range(9):
        cost.record(100, 0, 0.1)
    assert cost.per_prefill_token == pytest.approx((0.01 + 9 * 0.001) / 10)


def test_the_prefill_stall_is_what_decoding_steps_spend_on_prompts():
    cost = StepCost()
    teach(cost)
    assert cost.prefill_stall == 0.0  # (no step decoded beside a prompt)
    for _ in range(500):  # every other decode step carries a 100-token prompt
        cost.record(100, 4, BASE + 4 * PER_ROW + 100 * PER_TOKEN)
        cost.record(0, 4, BASE + 4 * PER_ROW)
    assert cost.prefill_stall == pytest.approx(100 * PER_TOKEN / 2, rel=0.1)
    assert cost.token_seconds(4) == pytest.approx(BASE + 4 * PER_ROW + 0.05, rel=0.1)


def test_step_composition_counts_prefill_tokens_and_decode_rows():
    sched = make_scheduler(learned=False)
    runner = FakeRunner(sched)
    sched.add_request(request("a", 10))
    out = sched.schedule()
    assert StepShape.of(out) == StepShape(10, 0, 0, 10 * 5)
    sched.update_from_output(out, runner(out))
    sched.add_request(request("b", 6))
    out = sched.schedule()
    shape = StepShape.of(out)  # a decodes beside b's prompt
    assert (shape.prefill_tokens, shape.decode_rows, shape.decode_context) == (6, 1, 11)


# ---- slack order -------------------------------------------------------------------------


def test_slack_order_runs_the_request_with_the_least_slack_first():
    """Deadlines minus estimated prefill: a long prompt with a later deadline can have less
    slack than a short one with an earlier deadline; arrival order does not matter."""
    sched = make_scheduler(slo=SLO(ttft_ms=10_000), max_num_seqs=1)
    assert isinstance(sched.waiting, SlackQueue)
    runner = FakeRunner(sched)
    sched.add_request(request("busy", max_tokens=50))
    step(sched, runner)  # busy takes the one seat
    sched.add_request(request("early", 8, arrival=NOW - 1, ttft_ms=3000))  # due NOW + 2
    sched.add_request(request("tight", 8, ttft_ms=1000))  # due NOW + 1
    # Due NOW + 1.2, but its 400 tokens take about 0.47 s: start by NOW + 0.73.
    sched.add_request(request("long", 400, ttft_ms=1200))
    sched.add_request(request("loose", 8, ttft_ms=10_000))
    assert waiting_ids(sched) == ["long", "tight", "early", "loose"]
    scheduled = []
    while sched.requests:
        scheduled += [rid for rid in step(sched, runner) if rid not in scheduled]
    assert scheduled == ["busy", "long", "tight", "early", "loose"]


def test_priority_still_ranks_before_slack():
    sched = make_scheduler("priority", SLO(ttft_ms=10_000))
    sched.add_request(request("urgent_low", ttft_ms=100, priority=5))
    sched.add_request(request("loose_high", ttft_ms=9000, priority=0))
    sched.add_request(request("tight_high", ttft_ms=500, priority=0))
    assert waiting_ids(sched) == ["tight_high", "loose_high", "urgent_low"]


def test_a_request_without_a_ttft_target_is_due_at_its_arrival():
    sched = make_scheduler(slo=SLO(tpot_ms=1000))  # targets on, no TTFT default
    sched.add_request(request("deadline", ttft_ms=5000, arrival=NOW))
    sched.add_request(request("none", arrival=NOW + 0.5))  # later, but never starved
    sched.add_request(request("later", arrival=NOW + 1))
    assert waiting_ids(sched) == ["none", "later", "deadline"]


# ---- admission -------------------------------------------------------------------------


def test_admission_refuses_a_first_token_the_queue_would_make_late():
    sched = make_scheduler(slo=SLO(ttft_ms=2000))
    cost = sched.deadlines.cost
    # Requests of 200 tokens, due in 2 s: admitted while the prompts ahead and its own fit.
    fits = max(n for n in range(1, 50) if cost.prefill_seconds(200 * n, 0, BUDGET) <= 2.0)
    for i in range(fits):
        sched.add_request(request(f"r{i}", 200, ttft_ms=2000))
    with pytest.raises(DeadlineUnmeetableError) as refused:
        sched.add_request(request("late", 200, ttft_ms=2000))
    error = refused.value
    assert isinstance(error, ValueError) and error.param == "slo_ttft_ms"
    assert "slo_ttft_ms cannot be met" in str(error) and error.retry_after >= 1
    assert "late" not in sched.requests and len(sched.waiting) == fits  # nothing queued
    assert sched.deadlines.num_refused == {"ttft": 1, "tpot": 0}
    # What can be met is admitted: a looser target, or a tighter one that goes first.
    sched.add_request(request("loose", 200, ttft_ms=60_000))
    sched.add_request(request("first", 8, ttft_ms=500))
    assert waiting_ids(sched)[0] == "first"
    assert sched.get_stats().num_slo_refused_ttft == 1


def test_admission_refuses_a_request_already_past_its_deadline():
    sched = make_scheduler(slo=SLO(ttft_ms=1000))
    with pytest.raises(DeadlineUnmeetableError):
        sched.add_request(request("stale", arrival=NOW - 5, ttft_ms=1000))  # 5 s at the door
    sched.add_request(request("fresh", arrival=NOW - 0.5, ttft_ms=1000))


def test_admission_refuses_what_would_slow_decode_past_a_tpot_target():
    """Each decode step costs 10 ms + 1 ms a row: a 20.5 ms TPOT holds 10 sequences."""
    sched = make_scheduler(slo=SLO(tpot_ms=20.5))
    for i in range(10):
        sched.add_request(request(f"r{i}", tpot_ms=20.5))
    with pytest.raises(DeadlineUnmeetableError) as refused:
        sched.add_request(request("eleventh", tpot_ms=20.5))
    assert refused.value.param == "slo_tpot_ms" and refused.value.retry_after >= 1
    # A request with only a TTFT target would slow the others past theirs: refused too.
    with pytest.raises(DeadlineUnmeetableError):
        sched.add_request(request("ttft_only", ttft_ms=60_000))
    assert sched.deadlines.num_refused == {"ttft": 0, "tpot": 2}
    # A request without targets is never refused (here: the server has TPOT only).
    sched.add_request(request("no_slo"))
    assert len(sched.requests) == 11


def test_prompts_stalling_the_decodes_count_against_tpot():
    """With requests running, a token waits for the prompts steps have carried of late."""
    sched = make_scheduler(slo=SLO(tpot_ms=20.5))
    runner = FakeRunner(sched)
    sched.add_request(request("running", tpot_ms=20.5, max_tokens=50))
    step(sched, runner)
    sched.deadlines.cost.prefill_stall = 0.008  # 8 ms of prompts a step
    # 10 ms + 1 ms a row + 8 ms: two sequences decoding fit (20 ms), three do not.
    sched.add_request(request("second", tpot_ms=20.5))
    with pytest.raises(DeadlineUnmeetableError):
        sched.add_request(request("third", tpot_ms=20.5))
    # An idle engine's stalls are nobody's: nothing running, only the decode step counts.
    idle = make_scheduler(slo=SLO(tpot_ms=20.5))
    idle.deadlines.cost.prefill_stall = 1.0
    idle.add_request(request("first", tpot_ms=20.5))


def test_the_margin():
    """Estimates are means: admission wants them to fit with MARGIN to spare. 1.25 x
    (10 ms + 1 ms a row) fits 20.5 ms with 6 rows, not 7."""
    sched = make_scheduler(slo=SLO(tpot_ms=20.5))
    sched.deadlines.MARGIN = Deadlines.MARGIN  # 1.25
    for i in range(6):
        sched.add_request(request(f"r{i}", tpot_ms=20.5))
    with pytest.raises(DeadlineUnmeetableError):
        sched.add_request(request("seventh", tpot_ms=20.5))


def test_fork_siblings_count_as_sequences():
    sched = make_scheduler(slo=SLO(tpot_ms=20.5))
    for i in range(8):
        sched.add_request(request(f"r{i}", tpot_ms=20.5))
    with pytest.raises(DeadlineUnmeetableError):
        sched.add_request(request("n3", tpot_ms=20.5), [request("n3#1"), request("n3#2")])
    sched.add_request(request("n2", tpot_ms=20.5), [request("n2#1")])


def test_nothing_is_refused_before_a_step_was_measured():
    sched = make_scheduler(slo=SLO(ttft_ms=1, tpot_ms=1), learned=False)
    for i in range(20):
        sched.add_request(request(f"r{i}", 200, ttft_ms=1, tpot_ms=1))
    assert len(sched.requests) == 20


def test_an_idle_engine_takes_a_request_whatever_the_estimate():
    """However wrong the estimate, an idle engine runs the next request (and learns from
    its steps): nothing else could ever correct it."""
    sched = make_scheduler(slo=SLO(ttft_ms=100, tpot_ms=10))
    sched.deadlines.cost.base = 60.0  # a minute a step
    sched.add_request(request("first", 400, ttft_ms=100, tpot_ms=10))
    with pytest.raises(DeadlineUnmeetableError):  # not idle any more
        sched.add_request(request("second", 8, ttft_ms=100, tpot_ms=10))


def test_step_cost_draws_no_line_of_any_slope_through_two_noisy_sizes():
    """Steps of one and two rows, one of them slowed (a page fault, a busy core): the
    line may not go below 0 at no rows, nor price a row as ten steps."""
    cost = StepCost()
    for _ in range(10):
        cost.record(0, 1, 0.010)
        cost.record(0, 2, 0.140)
    assert cost.base >= 0 and cost.per_decode_row >= 0
    assert cost.decode_seconds(1) <= 0.140 and cost.decode_seconds(32) < 10 * 0.140


# ---- off -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, queue", [("fcfs", FCFSQueue), ("priority", PriorityQueue)])
def test_without_targets_nothing_changes(policy, queue):
    """No server targets: the policy's own queue, and requests without targets are
    never refused, however loaded (the cost estimate learned a slow machine)."""
    sched = make_scheduler(policy)
    assert type(sched.waiting) is queue and sched.deadlines.slack is None
    for i in range(100):
        sched.add_request(request(f"r{i}", 400, arrival=NOW - i))  # later ids arrived first
    expected = [f"r{i}" for i in range(100)]
    assert waiting_ids(sched) == (expected if policy == "fcfs" else expected[::-1])
    assert sched.deadlines.num_refused == {"ttft": 0, "tpot": 0}


def test_a_request_target_on_a_server_without_targets_is_checked_in_fcfs_order():
    sched = make_scheduler()
    assert isinstance(sched.waiting, FCFSQueue)
    for i in range(10):
        sched.add_request(request(f"r{i}", 400))
    # Behind 4,000 prompt tokens (about 4.6 s): a 1 s target cannot be met.
    with pytest.raises(DeadlineUnmeetableError):
        sched.add_request(request("tight", 8, ttft_ms=1000))
    sched.add_request(request("patient", 8, ttft_ms=10_000))
    assert waiting_ids(sched)[-1] == "patient"
