"""The simulator against the real thing, on this machine, in one command:

1. `pagoda bench profile --num-threads 1` fits the step cost model (a replica of
   `--data-parallel-size 2` on 2 cores runs one thread);
2. a fresh `pagoda serve --data-parallel-size 2` (two replicas behind the prefix
   router, which follows their KV events) serves `shared-prefix` requests from `pagoda
   bench serve`'s client in each pass: 16 lone requests (what a request costs besides
   its steps, the HTTP hops and the router: the simulation adds that much to each),
   then a Poisson rate below saturation, then all at t=0 (capacity);
3. the simulator runs the same requests (same prompts, same arrival times) on two
   simulated replicas with that cost model.

TTFT p50 and output throughput of each pass, and their relative errors.

    python benchmarks/sim_validation.py --output-json docs/perf/sim_validation.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx

from pagoda.bench.report import cpu_name
from pagoda.entrypoints.processes import free_port, wait_healthy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--cost-model", default=None, help="skip the profile: this JSON")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    from pagoda.bench.workloads import assign_poisson_arrivals, make_workload
    from pagoda.model_executor.model_files import load_tokenizer, resolve_model
    from pagoda.sim.cost_model import StepCostModel
    from pagoda.sim.replica import ReplicaSpec
    from pagoda.sim.simulator import FleetSpec, Simulation
    from pagoda.sim.workloads import SimRequest

    cli = [sys.executable, "-m", "pagoda.entrypoints.cli"]
    workdir = tempfile.mkdtemp(prefix="pagoda-simval-")
    cost_path = args.cost_model or os.path.join(workdir, "cost_model.json")
    if args.cost_model is None:
        subprocess.run([*cli, "bench", "profile", "--num-threads", "1", "--output-json",
                        cost_path, "--no-progress"], check=True)  # fmt: skip
    cost = StepCostModel.from_json(cost_path)

    tokenizer = load_tokenizer(*resolve_model(None))
    base = make_workload("shared-prefix", tokenizer, seed=args.seed,
                         num_prompts=args.num_requests, num_prefixes=args.num_prefixes)  # fmt: skip
    passes, overhead = [], 0.0
    for rate in ("lone", args.request_rate, float("inf")):
        reqs = [copy.copy(r) for r in base]
        if rate == "lone":  # calibration: one at a time, what a request costs besides steps
            reqs = reqs[:16]
            for i, r in enumerate(reqs):
                r.arrival_time = 1.0 * i
        else:
            assign_poisson_arrivals(reqs, rate, random.Random(args.seed))
        real = _serve(cli, reqs, tokenizer, f"real, rate {rate}")
        sim_reqs = [SimRequest(r.arrival_time, r.prompt_token_ids, r.output_len) for r in reqs]
        fleet = FleetSpec(replicas=2, replica=ReplicaSpec(kv_tokens=1 << 17),
                          request_overhead_s=overhead)  # fmt: skip
        sim = Simulation(fleet, cost, sim_reqs).run()
        if rate == "lone":
            overhead = (real["ttft_ms"]["median"] - sim["ttft_ms"]["median"]) / 1e3
            print(f"per-request overhead: {1e3 * overhead:.0f} ms", flush=True)
            continue
        passes.append(_compare(rate, real, sim))
        print(json.dumps(passes[-1]), flush=True)

    out = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "workload": {
            "name": "shared-prefix",
            "num_requests": args.num_requests,
            "num_prefixes": args.num_prefixes,
            "seed": args.seed,
        },  # fmt: skip
        "cost_model": {k: v for k, v in cost.__dict__.items() if k != "source"},
        "cost_model_fit": {k: v for k, v in cost.source.items() if k != "measured"},
        "request_overhead_ms": 1e3 * overhead,
        "passes": passes,
        "error": {
            "ttft": max(p["error"]["ttft"] for p in passes),
            "throughput": max(p["error"]["throughput"] for p in passes),
        },
    }
    print(json.dumps(out["error"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


def _serve(cli: list[str], reqs, tokenizer, desc: str) -> dict:
    """`reqs` through a fresh `pagoda serve --data-parallel-size 2` (caches empty)."""
    from pagoda.bench.serve import make_payloads, run_pass

    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*cli, "serve", "--data-parallel-size", "2", "--port", str(port),
                               "--disable-uvicorn-access-log"])  # fmt: skip
    try:
        wait_healthy(url, server)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        payloads = make_payloads(reqs, tokenizer, "/v1/completions", model, True, None)
        time.sleep(3)  # the router's health check has seen both replicas
        return run_pass(url + "/v1/completions", payloads, reqs, tokenizer, False, desc=desc)
    finally:
        server.terminate()
        server.wait(60)


def _compare(rate: float, real: dict, sim: dict) -> dict:
    def err(a: float, b: float) -> float:
        return abs(a - b) / b

    real_row = {"ttft_p50_ms": real["ttft_ms"]["median"],
                "output_throughput": real["output_throughput"], "completed": real["completed"]}  # fmt: skip
    sim_row = {"ttft_p50_ms": sim["ttft_ms"]["median"],
               "output_throughput": sim["output_throughput"], "completed": sim["completed"],
               "prefix_cache_hit_rate": sim["prefix_cache_hit_rate"]}  # fmt: skip
    return {
        "request_rate": "inf" if rate == float("inf") else rate,
        "real": real_row,
        "sim": sim_row,
        "error": {
            "ttft": err(sim_row["ttft_p50_ms"], real_row["ttft_p50_ms"]),
            "throughput": err(sim_row["output_throughput"], real_row["output_throughput"]),
        },
    }


if __name__ == "__main__":
    main()
