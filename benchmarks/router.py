"""Replicas behind the prefix router, one command: `shared-prefix` with several
prefix families (64 requests at once, 448-token prefixes, 64 tokens out each).

    python benchmarks/router.py [--model M] [--num-prefixes 4] [--output-json F]

- 1 replica on all cores (`pagoda serve`);
- 2 replicas x 1 core behind `pagoda router --policy prefix`;
- the same following the replicas' KV events (`--kv-events`);
- the same behind `--policy round-robin`.

Each configuration starts fresh servers (empty caches); replicas are pinned to
their core. Reported: output tok/s, TTFT, and the replicas' own prefix-cache hit
rate (`pagoda:prefix_cache_hits_total / queries_total`). Figures are ratios
within this one command; name the CPU with them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from pagoda.bench.report import machine_info, versions
from pagoda.bench.serve import make_payloads, run_pass
from pagoda.bench.workloads import make_workload
from pagoda.model_executor.model_files import load_tokenizer, resolve_model

CLI = [sys.executable, "-m", "pagoda.entrypoints.cli"]


def start(args: list[str], port: int, cores: list[int] | None = None) -> subprocess.Popen:
    def pin() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)

    proc = subprocess.Popen(
        [*CLI, *args, "--port", str(port)],
        preexec_fn=pin,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{args} exited with {proc.returncode}")
        time.sleep(0.5)
    raise RuntimeError(f"{args} not ready")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)


def prefix_hit_rate(ports: list[int]) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "pagoda:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "pagoda:prefix_cache_queries_total":
                    queries += s.value
    return hits / queries if queries else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--balance-threshold", type=int, default=16, help="the router's")
    parser.add_argument("--skip-single", action="store_true", help="not the 1-replica run")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    path, is_gguf = resolve_model(ns.model)
    tokenizer = load_tokenizer(path, is_gguf)
    reqs = make_workload("shared-prefix", tokenizer, num_prefixes=ns.num_prefixes)
    model_args = [ns.model] if ns.model else []
    cores = sorted(os.sched_getaffinity(0))
    rows = []

    def measure(label: str, url_port: int, replica_ports: list[int]) -> None:
        model = httpx.get(f"http://127.0.0.1:{url_port}/v1/models").json()["data"][0]["id"]
        payloads = make_payloads(reqs, tokenizer, "/v1/completions", model, True, None)
        url = f"http://127.0.0.1:{url_port}/v1/completions"
        result = run_pass(url, payloads, reqs, tokenizer, False, progress=False)
        result.update(config=label, prefix_cache_hit_rate=prefix_hit_rate(replica_ports))
        rows.append(result)
        print(
            f"{label:34} {result['output_throughput']:7.1f} out tok/s   TTFT mean "
            f"{result['ttft_ms']['mean']:7.0f} ms   prefix hit rate "
            f"{result['prefix_cache_hit_rate']:.2f}",
            flush=True,
        )

    if not ns.skip_single:
        one = start(["serve", *model_args], 8100)
        try:
            measure(f"1 replica x {len(cores)} cores", 8100, [8100])
        finally:
            stop([one])
    for policy, events in (("prefix", []), ("prefix", ["--kv-events"]), ("round-robin", [])):
        replicas = [
            start(["serve", *model_args, "--num-threads", "1"], 8101 + i, [cores[i]])
            for i in range(2)
        ]
        backends = ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
        router = start(
            ["router", *model_args, "--policy", policy, "--backend", *backends,
             "--balance-threshold", str(ns.balance_threshold), *events],
            8100,
        )  # fmt: skip
        try:
            label = f"2 replicas x 1 core, {policy}{' + KV events' if events else ''}"
            measure(label, 8100, [8101, 8102])
        finally:
            stop([router, *replicas])
    if ns.output_json:
        record = {"machine": machine_info(), "versions": versions(), "runs": rows}
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
