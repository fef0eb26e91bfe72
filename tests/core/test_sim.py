"""`pagoda sim`: the cost model's fit, the workloads' shapes and arrival processes, and
the simulation's bookkeeping (exact step timing for a lone request, conservation,
routing, failures, autoscaling, the disk KV tier), all with pagoda's real scheduler
and router code."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from pagoda.core.kv_tier import HEADER_BYTES
from pagoda.core.step_shape import StepShape
from pagoda.sim.cli import format_results
from pagoda.sim.cost_model import StepCostModel, default_cost_model
from pagoda.sim.replica import ReplicaSpec
from pagoda.sim.simulator import FleetSpec, Simulation
from pagoda.sim.tier import SimTier, TierStore
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
         "--plot", str(png), "--kv-tier-bytes", "1000000000", "--kv-tier-shared",
         "--no-progress"],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["results"]["completed"] == 150
    assert 0 < data["results"]["goodput"] <= data["results"]["request_throughput"]
    assert data["command"].startswith("pagoda sim") and png.stat().st_size > 10_000
    tier = data["results"]["kv_tier"]
    assert tier["shared"] and tier["bytes_written"] > 0 and data["fleet"]["kv_tier_bytes"] == 10**9


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


# ---- the disk KV tier -------------------------------------------------------------


def _sessions() -> list[SimRequest]:
    """Conversations over 4 system prompts: about 20k tokens of history, against two
    replicas of 2k tokens of KV each."""
    return make_requests(WorkloadSpec("sessions", 120, 6.0, prefix_len=256, num_prefixes=4,
                                      output_len=16, turns=4, think_s=3.0))  # fmt: skip


def _run(fleet: FleetSpec, reqs: list[SimRequest]) -> dict:
    sim = Simulation(fleet, COST, reqs)
    r = sim.run()
    assert r["completed"] == len(reqs)
    for replica in sim.replicas:  # nothing held: not for the tier, not by a request
        assert replica.kv.block_pool.num_used_blocks == 0
    return r


def test_the_disk_tier_keeps_what_memory_cannot():
    """Each conversation's history is evicted from its replica's 2k tokens of KV by
    the time it comes round again; with a tier, it is read back instead of computed,
    each read costing its bytes at the tier's bandwidth."""
    reqs, spec = _sessions(), ReplicaSpec(kv_tokens=2048, max_num_batched_tokens=512)
    off = _run(FleetSpec(replicas=2, replica=spec), reqs)
    on = _run(FleetSpec(replicas=2, replica=spec, kv_tier_bytes=1 << 30), reqs)
    assert off["kv_tier"] is None
    tier = on["kv_tier"]
    assert on["prefix_cache_hit_rate"] > off["prefix_cache_hit_rate"] + 0.05
    assert tier["hit_rate"] > 0.05 and tier["hit_tokens"] > 0
    assert on["ttft_ms"]["p90"] < 0.7 * off["ttft_ms"]["p90"]
    assert on["ttft_ms"]["mean"] < off["ttft_ms"]["mean"]
    file_bytes = 23040 * 16 + HEADER_BYTES
    assert (
        tier["bytes_read"] == tier["hit_tokens"] // 16 * file_bytes
    )  # (every block read was loaded)
    assert tier["read_s"] == pytest.approx(tier["bytes_read"] / 2e9)
    assert tier["stored_bytes"] == tier["bytes_written"] and tier["evicted_blocks"] == 0
    assert sum(r["bytes_read"] for r in tier["per_replica"]) == tier["bytes_read"]
    assert "disk tier (per replica): hit rate" in format_results(on, 2, "prefix", 0.0)
    assert "disk tier" not in format_results(off, 2, "prefix", 0.0)


def test_a_shared_tier_finds_what_another_replica_wrote():
    """Round-robin: a prompt's prefix computed on replica 0 is read from a shared tier
    by replica 1, whose first token then takes the rest's prefill and the read; with
    a tier each, replica 1 computes it all."""
    prefix = list(range(1000, 1256))  # 16 blocks
    reqs = [SimRequest(0.0, prefix + [7] * 16, 2), SimRequest(5.0, prefix + [9] * 16, 2)]
    spec = ReplicaSpec(kv_tokens=4096)
    fleet = FleetSpec(replicas=2, policy="round-robin", replica=spec, kv_tier_bytes=1 << 30)
    own = _run(fleet, reqs)
    shared = _run(dataclasses.replace(fleet, kv_tier_shared=True), reqs)
    assert [r["hit_tokens"] for r in own["kv_tier"]["per_replica"]] == [0, 0]
    assert [r["hit_tokens"] for r in shared["kv_tier"]["per_replica"]] == [0, 256]
    file_bytes = 23040 * 16 + HEADER_BYTES
    # Replica 1 writes only its own last block: the tier holds the prefix's already.
    written = [r["bytes_written"] for r in shared["kv_tier"]["per_replica"]]
    assert written == [17 * file_bytes, file_bytes]
    cold = COST.seconds(StepShape(272, 0, 0, 272 * 136))
    warm = COST.seconds(StepShape(16, 0, 0, 16 * (256 + 8))) + 16 * file_bytes / 2e9
    assert own["ttft_ms"]["mean"] == pytest.approx(cold * 1e3)
    assert shared["ttft_ms"]["mean"] == pytest.approx((cold + warm) / 2 * 1e3)


def test_the_tier_budget_drops_the_least_recently_used():
    store = TierStore(3 * (100 + HEADER_BYTES), block_bytes=100)
    tier = SimTier(store)
    assert all(tier.save(bytes([i]) * 16, i) for i in range(3))
    assert tier.take_saved() == [0, 1, 2] and tier.take_saved() == []  # copied at once
    assert tier.stage([bytes([0]) * 16, bytes([9]) * 16]) == 1  # block 0: now the most recent
    assert not tier.save(bytes([0]) * 16, 5)  # held already: not written again
    assert tier.save(bytes([3]) * 16, 3)
    assert not tier.holds(bytes([1]) * 16) and tier.holds(bytes([0]) * 16)
    stats = tier.snapshot()
    assert stats.stored_blocks == 3 and stats.stored_bytes <= store.max_bytes
    assert stats.blocks_removed == 1 and stats.hits == 1 and stats.queries == 2
    # In a fleet: a budget of 50 blocks a replica is kept to, the rest dropped.
    budget = 50 * (23040 * 16 + HEADER_BYTES)
    spec = ReplicaSpec(kv_tokens=2048, max_num_batched_tokens=512)
    r = _run(FleetSpec(replicas=2, replica=spec, kv_tier_bytes=budget), _sessions())
    assert r["kv_tier"]["stored_bytes"] == 2 * budget and r["kv_tier"]["evicted_blocks"] > 0
