"""Routing policies at 10, 100 and 1,000 replicas, by simulation (`pagoda sim`'s parts:
each replica pagoda's scheduler and KV cache with the shipped cost model, the
router's own policy code), and the router's defaults checked against neighbours.

Workload: `shared-prefix` with 4 prefix families per replica (448-token prefixes, 64
tokens of their own, 64 out), 20 requests per replica arriving as a Poisson process
at 2 per replica per second (about two thirds of what a replica of the shipped cost
model serves); each replica's KV cache holds 32k tokens, so it keeps about 70 of the
fleet's prefixes: routing decides whether a family's prefix is computed once or on
every replica.

    python benchmarks/sim_routing.py --output-json docs/perf/sim_routing.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagoda.sim.cost_model import default_cost_model
from pagoda.sim.replica import ReplicaSpec
from pagoda.sim.simulator import FleetSpec, Simulation
from pagoda.sim.workloads import WorkloadSpec, make_requests

POLICIES = ("round-robin", "least-loaded", "prefix")


def run(replicas: int, policy: str, **fleet) -> dict:
    spec = WorkloadSpec("shared-prefix", 20 * replicas, 2.0 * replicas, prompt_len=512,
                        prefix_len=448, num_prefixes=4 * replicas, output_len=64)  # fmt: skip
    reqs = make_requests(spec)
    started = time.perf_counter()
    fleet = FleetSpec(replicas=replicas, policy=policy, replica=ReplicaSpec(kv_tokens=32768),
                      **fleet)  # fmt: skip
    r = Simulation(fleet, default_cost_model(), reqs).run()
    row = {
        "replicas": replicas, "policy": policy, **{k: v for k, v in fleet.__dict__.items()
                                                   if k in ("balance_threshold", "prefix_table_size")},
        "ttft_p50_ms": r["ttft_ms"]["median"], "ttft_p99_ms": r["ttft_ms"]["p99"],
        "tpot_p50_ms": r["tpot_ms"]["median"], "output_throughput": r["output_throughput"],
        "prefix_cache_hit_rate": r["prefix_cache_hit_rate"], "wall_s": time.perf_counter() - started,
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="10,100,1000")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    policies = [run(n, policy) for n in sizes for policy in POLICIES]
    thresholds = [run(100, "prefix", balance_threshold=t) for t in (0, 4, 16, 64, 256)]
    tables = [run(100, "prefix", prefix_table_size=s) for s in (1 << 12, 1 << 15, 1 << 20)]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "cost_model": "shipped",
                       "policies": policies, "balance_threshold": thresholds,
                       "prefix_table_size": tables}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
