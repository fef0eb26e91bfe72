"""`pagoda sim`: a fleet of replicas in simulated time (see pagoda/sim/__init__.py)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from pagoda.entrypoints.router.config import POLICIES
from pagoda.sim.workloads import ARRIVALS, WORKLOADS


def _failure(text: str) -> tuple[float, int]:
    at, sep, index = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--fail {text!r}: expected SECONDS:REPLICA")
    return float(at), int(index)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim", help="simulate a fleet of replicas: pagoda's scheduler and router, modelled steps"
    )
    p.add_argument("--replicas", type=int, default=2)
    # (pd, prefill on other replicas through a shared disk tier, is not simulated)
    p.add_argument("--policy", choices=[x for x in POLICIES if x != "pd"], default="prefix")
    p.add_argument("--balance-threshold", type=int, default=64)
    p.add_argument("--prefix-table-size", type=int, default=1 << 20)
    p.add_argument("--no-kv-events", action="store_true", help="the router's history only")
    p.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    p.add_argument("--trace", default=None, metavar="JSONL", help="requests from a trace instead")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=10.0, help="requests per second")
    p.add_argument("--arrivals", choices=ARRIVALS, default="poisson")
    p.add_argument("--burstiness", type=float, default=4.0, help="gamma arrivals: gaps' CV")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=448)
    p.add_argument("--turns", type=int, default=4, help="sessions: turns per conversation")
    p.add_argument("--think-s", type=float, default=30.0, help="sessions: seconds between turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-model", default=None, metavar="JSON",
                   help="from `pagoda bench profile` (default: the shipped one)")  # fmt: skip
    p.add_argument("--kv-tokens", type=int, default=65536, help="each replica's KV cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--kv-bytes-per-token", type=int, default=23040,
                   help="a token's K/V, for the disk tier (default: SmolLM2-135M, bf16)")  # fmt: skip
    p.add_argument("--kv-tier-bytes", type=int, default=0,
                   help="a disk KV tier of this many bytes per replica (0: none)")  # fmt: skip
    p.add_argument("--kv-tier-shared", action="store_true",
                   help="one disk tier of --kv-tier-bytes for the whole fleet")  # fmt: skip
    p.add_argument("--kv-tier-read-gbps", type=float, default=2.0, help="the tier's reads, GB/s")
    p.add_argument("--request-overhead-ms", type=float, default=0.0,
                   help="added to each request's TTFT and latency (HTTP, tokenizing)")  # fmt: skip
    p.add_argument("--scale-waiting", type=float, default=None,
                   help="autoscale: add a replica while waiting requests per replica exceed this")  # fmt: skip
    p.add_argument("--scale-kv", type=float, default=None,
                   help="autoscale: add a replica while mean KV usage exceeds this (0..1)")  # fmt: skip
    p.add_argument("--max-replicas", type=int, default=None)
    p.add_argument("--scale-interval", type=float, default=10.0)
    p.add_argument("--startup-delay", type=float, default=60.0, help="seconds to a new replica")
    p.add_argument("--fail", type=_failure, action="append", default=[], metavar="SECONDS:REPLICA",
                   help="lose a replica at a time (repeat)")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput's TTFT target")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput's TPOT target")
    p.add_argument("--shed", action="store_true",
                   help="the replicas serve to those targets (pagoda serve --slo-*-ms): "
                   "slack order, requests that cannot meet them refused")  # fmt: skip
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="latency and replicas over time")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_sim)


def cmd_sim(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagoda.bench.report import cpu_name
    from pagoda.sim.cost_model import StepCostModel, default_cost_model
    from pagoda.sim.replica import ReplicaSpec
    from pagoda.sim.simulator import FleetSpec, Simulation
    from pagoda.sim.workloads import WorkloadSpec, load_trace, make_requests

    cost = StepCostModel.from_json(ns.cost_model) if ns.cost_model else default_cost_model()
    replica = ReplicaSpec(
        ns.kv_tokens, ns.block_size, ns.max_num_seqs, ns.max_num_batched_tokens,
        ns.max_model_len, slo_ttft_ms=ns.slo_ttft_ms if ns.shed else None,
        slo_tpot_ms=ns.slo_tpot_ms if ns.shed else None, kv_bytes_per_token=ns.kv_bytes_per_token,
    )  # fmt: skip
    fleet = FleetSpec(
        replicas=ns.replicas, policy=ns.policy, balance_threshold=ns.balance_threshold,
        prefix_table_size=ns.prefix_table_size, kv_events=not ns.no_kv_events,
        replica=replica, request_overhead_s=ns.request_overhead_ms / 1e3,
        scale_waiting=ns.scale_waiting, scale_kv=ns.scale_kv, max_replicas=ns.max_replicas,
        scale_interval=ns.scale_interval, startup_delay=ns.startup_delay,
        failures=tuple(ns.fail), slo_ttft_ms=ns.slo_ttft_ms, slo_tpot_ms=ns.slo_tpot_ms,
        kv_tier_bytes=ns.kv_tier_bytes, kv_tier_shared=ns.kv_tier_shared,
        kv_tier_read_gbps=ns.kv_tier_read_gbps,
    )  # fmt: skip
    if ns.trace:
        reqs = load_trace(ns.trace, ns.seed)
        workload = {"trace": ns.trace}
    else:
        spec = WorkloadSpec(
            ns.workload, ns.num_requests, ns.request_rate, ns.arrivals, ns.burstiness,
            ns.prompt_len, ns.output_len, ns.num_prefixes, ns.prefix_len, ns.turns,
            ns.think_s, ns.seed,
        )  # fmt: skip
        reqs = make_requests(spec)
        workload = spec.__dict__
    started = time.perf_counter()
    with tqdm(total=len(reqs), desc="simulated requests", disable=ns.no_progress) as bar:
        results = Simulation(fleet, cost, reqs).run(bar)
    wall = time.perf_counter() - started
    print(format_results(results, ns.replicas, ns.policy, wall))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({
                "command": "pagoda " + " ".join(sys.argv[1:]),
                "machine": {"arch": platform.machine(), "cpu": cpu_name()},
                "wall_s": wall,
                "workload": workload,
                "fleet": {k: v for k, v in fleet.__dict__.items() if k != "replica"},
                "replica": replica.__dict__,
                "cost_model": cost.__dict__,
                "results": results,
            }, f, indent=1)  # fmt: skip
    if ns.plot:
        plot(ns.plot, results, f"{ns.replicas} replicas, {ns.policy}, {len(reqs)} requests")
    return 0


def format_results(r: dict, replicas: int, policy: str, wall: float) -> str:
    def ms(summary: dict, key: str) -> str:
        return "-" if summary[key] is None else f"{summary[key]:.0f}"

    tier = r["kv_tier"]
    tier_line = [] if tier is None else [
        f"  disk tier ({'shared' if tier['shared'] else 'per replica'}): hit rate "
        f"{tier['hit_rate']:.3f} ({tier['hit_tokens']} tokens); "
        f"{tier['bytes_written'] / 1e9:.2f} GB written, {tier['bytes_read'] / 1e9:.2f} GB read",
    ]  # fmt: skip
    return "\n".join([
        f"{replicas} replicas ({policy}): {r['completed']} completed, {r['failed']} failed, "
        f"{r['refused']} refused, "
        f"{r['duration_s']:.1f} s simulated in {wall:.1f} s",
        f"  throughput {r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} out tok/s;"
        f" goodput {r['goodput']:.2f} req/s",
        f"  TTFT p50 {ms(r['ttft_ms'], 'median')} ms, p99 {ms(r['ttft_ms'], 'p99')} ms;"
        f" TPOT p50 {ms(r['tpot_ms'], 'median')} ms, p99 {ms(r['tpot_ms'], 'p99')} ms",
        f"  prefix-cache hit rate {r['prefix_cache_hit_rate']:.3f}; "
        f"{r['replica_seconds']:.0f} replica-seconds (at most {r['max_replicas']} replicas)",
        *tier_line,
    ])  # fmt: skip


def plot(path: str, results: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ("median", "p90", "p99")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "end to end")):
        values = [results[key][n] or 0 for n in names]
        left.plot(names, values, marker="o", label=label)
    left.set_yscale("log")
    left.set_ylabel("ms")
    left.legend()
    left.set_title("latency percentiles")
    times, counts = zip(*results["replicas_over_time"], strict=True)
    right.step([*times, results["duration_s"]], [*counts, counts[-1]], where="post")
    right.set_xlabel("simulated s")
    right.set_ylabel("replicas serving")
    right.set_title("replicas over time")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
