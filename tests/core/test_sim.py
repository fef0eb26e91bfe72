"""`pagoda sim`: the cost model's fit, the workloads' shapes and arrival processes, and
the simulation's bookkeeping (exact step timing for a lone request, conservation,
routing, failures, autoscaling), all with pagoda's real scheduler and router code."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pagoda.core.step_shape import StepShape
from pagoda.sim.cost_model import StepCostModel, default_cost_model
from pagoda.sim.replica import ReplicaSpec
from pagoda.sim.simulator import FleetSpec, Simulation
from pagoda.sim.workloads import (
    SimRequest,
    WorkloadSpec,
    arrival_times,
    load_trace,
    make_requests,
)
from tests.helpers import ROOT

COST = StepCostModel(
    overhead=0.004, per_prefill_token=0.0005, per_decode_row=0.001,
    per_decode_context=1e-6, per_prefill_attention=1e-8,
)  # fmt: skip


def test_fit_recovers_a_linear_model_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    shapes = [
        StepShape(int(p), int(d), int(d * c), float(p * (c + p / 2)))
        for p, d, c in zip(
            rng.integers(0, 2048, 300),
            rng.integers(0, 64, 300),
            rng.integers(16, 2048, 300),
            strict=True,
        )  # fmt: skip
    ]
    seconds = [COST.seconds(s) for s in shapes]
    fitted = StepCostModel.fit(shapes, seconds, {"machine": "test"})
    for name in ("overhead", "per_prefill_token", "per_decode_row", "per_decode_context",
                 "per_prefill_attention"):  # fmt: skip
        assert getattr(fitted, name) == pytest.approx(getattr(COST, name), rel=1e-6)
    assert fitted.source["mean_abs_error"] < 1e-9 and fitted.source["machine"] == "test"
    fitted.to_json(str(tmp_path / "m.json"))
    assert StepCostModel.from_json(str(tmp_path / "m.json")) == fitted
    shipped = default_cost_model()
    assert shipped.seconds(StepShape(0, 1, 100)) > 0 and shipped.source["cpu"]


def test_a_lone_request_takes_exactly_its_steps():
    """One request of 100 prompt tokens and 5 output tokens on one replica: its first
    token comes after one prefill step, and each next one after a decode step of one
    row over a context one longer."""
    spec = ReplicaSpec(kv_tokens=4096, max_num_batched_tokens=2048)
    prompt = list(range(1000, 1100))
    r = Simulation(FleetSpec(replicas=1, replica=spec), COST,
                   [SimRequest(2.0, prompt, 5)]).run()  # fmt: skip
    prefill = COST.seconds(StepShape(100, 0, 0, 100 * 50))
    decode = sum(COST.seconds(StepShape(0, 1, 100 + k + 1)) for k in range(4))
    assert r["ttft_ms"]["median"] == pytest.approx(prefill * 1e3)
    assert r["e2el_ms"]["median"] == pytest.approx((prefill + decode) * 1e3)
    assert r["completed"] == 1 and r["failed"] == 0
    # Chunked: a budget of 64 tokens takes the prompt in two steps.
    spec = ReplicaSpec(kv_tokens=4096, max_num_batched_tokens=64)
    r = Simulation(FleetSpec(replicas=1, replica=spec), COST, [SimRequest(0.0, prompt, 5)]).run()
    chunks = COST.seconds(StepShape(64, 0, 0, 64 * 32)) + COST.seconds(StepShape(36, 0, 0, 36 * 82))
    assert r["ttft_ms"]["median"] == pytest.approx(chunks * 1e3)


def test_workload_shapes():
    spec = WorkloadSpec("shared-prefix", 400, 10.0, prompt_len=96, prefix_len=64, num_prefixes=4)
    reqs = make_requests(spec)
    assert len(reqs) == 400 and all(len(r.prompt) == 96 for r in reqs)
    assert len({tuple(r.prompt[:64]) for r in reqs}) == 4
    assert make_requests(spec) == reqs  # seeded
    sessions = make_requests(WorkloadSpec("sessions", 40, 4.0, num_prefixes=2, prefix_len=32,
                                          output_len=8, turns=4, think_s=5.0))  # fmt: skip
    by_start: dict = {}
    for r in sessions:
        by_start.setdefault(tuple(r.prompt[:96]), []).append(r)
    for turns in by_start.values():  # each turn resends the one before and its answer
        turns.sort(key=lambda r: r.arrival)
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.prompt[: len(a.prompt)] == a.prompt
            assert len(b.prompt) == len(a.prompt) + 8 + 64
            assert b.arrival == pytest.approx(a.arrival + 5.0)


def test_arrival_processes():
    rng = np.random.default_rng(1)
    poisson = arrival_times(20000, 50.0, "poisson", rng)
    assert 20000 / poisson[-1] == pytest.approx(50.0, rel=0.03)
    gaps = np.diff(arrival_times(20000, 50.0, "gamma", rng, burstiness=4.0))
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(4.0, rel=0.15)  # bursty
    day = arrival_times(20000, 50.0, "day", rng)
    thirds = np.histogram(day, bins=3, range=(0, day[-1]))[0]
    assert thirds[1] > 2 * thirds[0] and thirds[1] > 2 * thirds[2]  # the day's peak
    with pytest.raises(ValueError, match="arrivals"):
        WorkloadSpec(arrivals="weekly")


def test_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"time": 0.5, "prompt_tokens": 100, "output_tokens": 10, "prefix_id": "sys", "prefix_tokens": 64},
        {"time": 0.0, "prompt_tokens": 80, "output_tokens": 5, "prefix_id": "sys", "prefix_tokens": 64},
        {"time": 1.0, "prompt_tokens": 50, "output_tokens": 4, "session": 7},
        {"time": 2.0, "prompt_tokens": 70, "output_tokens": 4, "session": 7},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = load_trace(str(path))
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.0, 2.0]
    assert [len(r.prompt) for r in reqs] == [80, 100, 50, 70]
    assert reqs[0].prompt[:64] == reqs[1].prompt[:64] and reqs[0].prompt[64] != reqs[1].prompt[64]
    assert reqs[3].prompt[:50] == reqs[2].prompt  # the session's history
    path.write_text('{"time": 1}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        load_trace(str(path))


def _shared(n: int = 600, rate: float = 40.0) -> list[SimRequest]:
    return make_requests(WorkloadSpec("shared-prefix", n, rate, prompt_len=320, prefix_len=256,
                                      num_prefixes=8, output_len=16))  # fmt: skip


def test_prefix_routing_keeps_families_together():
    reqs = _shared()
    rates = {}
    for policy in ("prefix", "round-robin"):
        r = Simulation(FleetSpec(replicas=8, policy=policy), COST, reqs).run()
        assert r["completed"] == len(reqs) and r["failed"] == 0
        rates[policy] = r["prefix_cache_hit_rate"]
    assert rates["prefix"] > rates["round-robin"] + 0.05
    again = Simulation(FleetSpec(replicas=8), COST, reqs).run()
    assert again == Simulation(FleetSpec(replicas=8), COST, reqs).run()  # deterministic


def test_a_lost_replica_fails_only_what_it_held():
    reqs = _shared(400, 40.0)
    r = Simulation(FleetSpec(replicas=4, failures=((3.0, 1),)), COST, reqs).run()
    assert 0 < r["failed"] < 40
    assert r["completed"] + r["failed"] == len(reqs)
    assert r["replicas_over_time"][0] == (0.0, 4)


def test_autoscaling_adds_replicas_under_load_and_removes_them_after():
    reqs = _shared(800, 200.0)
    fleet = FleetSpec(replicas=1, scale_waiting=2.0, max_replicas=4, scale_interval=0.5,
                      startup_delay=1.0)  # fmt: skip
    r = Simulation(fleet, COST, reqs).run()
    assert r["completed"] == len(reqs) and r["max_replicas"] == 4
    fixed = Simulation(FleetSpec(replicas=1), COST, reqs).run()
    assert r["ttft_ms"]["p90"] < fixed["ttft_ms"]["p90"]
    assert r["replica_seconds"] < 4 * r["duration_s"]  # not all of them all the time


def test_the_command(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "sim", "--replicas", "3",
         "--num-requests", "150", "--request-rate", "20", "--workload", "sessions",
         "--arrivals", "gamma", "--slo-ttft-ms", "500", "--output-json", str(out),
         "--plot", str(png), "--no-progress"],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["results"]["completed"] == 150
    assert 0 < data["results"]["goodput"] <= data["results"]["request_throughput"]
    assert data["command"].startswith("pagoda sim") and png.stat().st_size > 10_000


def test_shedding_keeps_goodput_under_overload():
    """Past saturation, replicas serving to their targets (the engine's own slack order
    and admission, on the simulated clock) refuse what they cannot finish in time, and
    finish more requests in time than replicas that queue everything."""
    reqs = _shared(600, 150.0)
    spec = ReplicaSpec(kv_tokens=65536)
    slo = {"slo_ttft_ms": 1000.0, "slo_tpot_ms": 100.0}
    queued = Simulation(FleetSpec(replicas=2, replica=spec, **slo), COST, reqs).run()
    shed_spec = ReplicaSpec(kv_tokens=65536, slo_ttft_ms=1000.0, slo_tpot_ms=100.0)
    shed = Simulation(FleetSpec(replicas=2, replica=shed_spec, **slo), COST, reqs).run()
    assert queued["refused"] == 0 and shed["refused"] > 0
    assert shed["completed"] + shed["refused"] == len(reqs)
    assert shed["goodput"] > 1.5 * queued["goodput"]
    assert shed["ttft_ms"]["p90"] < queued["ttft_ms"]["p90"]
