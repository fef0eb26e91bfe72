"""Serving to a deadline under overload: goodput with and without load shedding.

    python benchmarks/slo_overload.py [--model M] [--rates 1,2,4,8]
        [--slo-ttft-ms X --slo-tpot-ms Y] [--output-json docs/perf/slo_overload.json]

`pagoda serve` is started twice on the same model (the default: SmolLM2-135M's GGUF):
once as it is (no targets: everything queues), once with `--slo-ttft-ms X
--slo-tpot-ms Y` (the waiting queue by slack, and requests that cannot meet their
targets refused with a 429 at once). Each is driven by `pagoda bench serve`'s client
with the same seeded `online` requests (Poisson arrivals, prompts of 32-512 tokens,
outputs capped at 64; a fresh set for each rate) at each rate, from below saturation
to well past it. Reported per rate: goodput
(requests/s that met both targets, measured at the client: TTFT from the scheduled
arrival, TPOT over the stream), completed and refused counts, TTFT p50/p99.

Without targets given, they are set from the server without shedding at the lowest
rate (where nothing should be late): TTFT 3x and TPOT 2x its p90, rounded up. Goodput
is counted for every pass against the same targets.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import signal
import subprocess
import sys

import httpx

from pagoda.bench.report import machine_info, versions
from pagoda.bench.serve import make_payloads, run_pass
from pagoda.bench.workloads import assign_poisson_arrivals, make_workload
from pagoda.entrypoints.processes import wait_healthy
from pagoda.model_executor.model_files import load_tokenizer, resolve_model

CLI = [sys.executable, "-m", "pagoda.entrypoints.cli"]
PORT = 8131


def start(args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*CLI, "serve", *args, "--port", str(PORT), "--disable-uvicorn-access-log"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_healthy(f"http://127.0.0.1:{PORT}", proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


SERVER_SAMPLES = (
    "pagoda:request_slo_",  # its goodput counters
    "pagoda:step_cost_",  # the step cost estimate admission goes by
    "pagoda:time_to_first_token_seconds_",  # its own TTFT and TPOT (_sum, _count)
    "pagoda:request_time_per_output_token_seconds_",
)


def server_samples() -> dict[str, float]:
    """The server's goodput counters, step cost estimate and latency sums (summed over
    labels; histograms' _sum and _count only)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{PORT}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(SERVER_SAMPLES) and not s.name.endswith(("_bucket", "_created")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def round_up(value: float, step: float) -> float:
    return step * math.ceil(value / step)


def count_good(result: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> int:
    """Requests of a pass that met both targets (as `bench serve` counts goodput)."""
    per = result["per_request"]
    return sum(
        ttft is not None and ttft <= slo_ttft_ms and (tpot is None or tpot <= slo_tpot_ms)
        for ttft, tpot in zip(per["ttft_ms"], per["tpot_ms"], strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rates", default="1,2,4,8", help="requests/s, one pass each")
    parser.add_argument("--num-prompts", type=int, default=60, help="requests per pass")
    parser.add_argument("--max-output-len", type=int, default=64, help="cap on `online`'s")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    rates = sorted(float(r) for r in ns.rates.split(","))
    path, is_gguf = resolve_model(ns.model)
    tokenizer = load_tokenizer(path, is_gguf)
    # One set of requests per rate (the prefix cache must not serve a pass from the one
    # before), the same for both servers.
    workloads = []
    for i in range(len(rates)):
        reqs = make_workload("online", tokenizer, seed=ns.seed + i, num_prompts=ns.num_prompts)
        for r in reqs:
            r.output_len = min(r.output_len, ns.max_output_len)
        workloads.append(reqs)
    model_args = [ns.model] if ns.model else []
    url = f"http://127.0.0.1:{PORT}/v1/completions"
    slo = {"ttft": ns.slo_ttft_ms, "tpot": ns.slo_tpot_ms}
    rows = []

    def sweep(label: str, server_args: list[str]) -> None:
        proc = start([*model_args, *server_args])
        try:
            model = httpx.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"][0]["id"]
            warm = make_workload("online", tokenizer, seed=ns.seed - 1, num_prompts=1)
            warm_payloads = make_payloads(warm, tokenizer, "/v1/completions", model, True, None)
            # One request first: the engine's first steps (cold caches) are not timed.
            run_pass(url, warm_payloads, warm, tokenizer, False, progress=False)
            for rate, base_reqs in zip(rates, workloads, strict=True):
                payloads = make_payloads(base_reqs, tokenizer, "/v1/completions", model, True, None)
                reqs = [copy.copy(r) for r in base_reqs]
                assign_poisson_arrivals(reqs, rate, random.Random(ns.seed))
                before = server_samples()
                result = run_pass(url, payloads, reqs, tokenizer, False, progress=False)
                after = server_samples()
                server = {k: v for k, v in after.items() if "step_cost" in k}  # at the end
                server.update(
                    {k: v - before.get(k, 0.0) for k, v in after.items() if "step_cost" not in k}
                )
                result.update(system=label, request_rate=rate, server=server)
                rows.append(result)
                print(
                    f"{label:14} rate {rate:5.2f}/s  ok {result['completed']:3d}  refused "
                    f"{result['refused']:3d}  TTFT p50 {result['ttft_ms']['median']:7.0f} ms  "
                    f"p99 {result['ttft_ms']['p99']:7.0f} ms  TPOT p50 "
                    f"{result['tpot_ms']['median']:5.1f} ms",
                    flush=True,
                )
                if slo["ttft"] is None:  # the lowest rate, without shedding: nothing late
                    slo["ttft"] = round_up(3 * result["ttft_ms"]["p90"], 100)
                    slo["tpot"] = round_up(2 * result["tpot_ms"]["p90"], 10)
                    print(f"targets: TTFT {slo['ttft']:g} ms, TPOT {slo['tpot']:g} ms")
        finally:
            stop(proc)

    sweep("no shedding", [])
    sweep(
        "SLO shedding", ["--slo-ttft-ms", f"{slo['ttft']:g}", "--slo-tpot-ms", f"{slo['tpot']:g}"]
    )
    print(
        f"\ngoodput: requests/s that met TTFT <= {slo['ttft']:g} ms and TPOT <= {slo['tpot']:g} ms"
    )
    print(
        f"{'rate':>6} {'system':14} {'goodput':>8} {'ok':>4} {'429':>4} {'TTFT p50':>9} {'p99':>8}"
    )
    for row in rows:
        good = count_good(row, slo["ttft"], slo["tpot"])
        row.update(good=good, goodput=good / row["duration_s"])
        row.pop("per_request")
        ttft = row["ttft_ms"]
        print(
            f"{row['request_rate']:6g} {row['system']:14} {row['goodput']:8.2f} "
            f"{row['completed']:4d} {row['refused']:4d} {ttft['median']:9.0f} {ttft['p99']:8.0f}"
        )
    if ns.output_json:
        record = {
            "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
            "machine": machine_info(),
            "python": platform.python_version(),
            "versions": versions(),
            "model": ns.model or path,
            "workload": {
                "name": "online",
                "num_prompts": ns.num_prompts,
                "max_output_len": ns.max_output_len,
                "seed": ns.seed,
            },
            "slo_ttft_ms": slo["ttft"],
            "slo_tpot_ms": slo["tpot"],
            "results": rows,
        }
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
