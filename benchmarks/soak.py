"""Soak: many short requests through a real `pagoda serve`, watching its memory.

    python benchmarks/soak.py [--num-requests 20000] [--concurrency 16] \\
        [--output-json soak.json] [--plot soak.png] [-- extra pagoda serve flags]

A seeded mix, 16 in flight: completions and chat, streamed or not, some with
logprobs, stop strings, n=2, seeds or penalties; 2% bad requests (they must get
400) and 3% clients that hang up mid-stream. The server's resident memory (RSS)
is read every 500 requests; the run passes when RSS at the end is within 5% of
RSS after the first 2,000 (the KV pool has cycled many times by then), every
good request got 200, and no KV block is in use once idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "paged",
    "attention",
    "keeps",
    "cache",
    "in",
    "blocks",
    "continuous",
    "batching",
    "schedules",
    "one",
    "step",
    "at",
    "a",
    "time",
    "large",
    "language",
    "models",
    "generate",
    "text",
    "token",
    "by",
    "token",
    "a",
    "scheduler",
    "decides",
    "who",
    "runs",
    "what",
    "is",
    "the",
    "capital",
    "of",
    "france",
    "tell",
    "me",
    "a",
    "short",
    "story",
    "about",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_request(rng: random.Random, i: int) -> tuple[str, dict, str]:
    """(route, body, what to expect: "ok" | "bad" | "hang_up")."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
    body: dict = {"max_tokens": rng.randint(4, 16), "stream": rng.random() < 0.5}
    if rng.random() < 0.6:
        route, body["prompt"] = "/v1/completions", prompt
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 5)
    else:
        route = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.3:
        body["seed"], body["temperature"] = i, 0.8
    else:
        body["temperature"] = 0.0
    if rng.random() < 0.1:
        body["presence_penalty"] = 0.5
    roll = rng.random()
    if roll < 0.02:
        body["stop_token_ids"] = [10**9]  # out of the vocabulary: a 400
        return route, body, "bad"
    if roll < 0.05 and body["stream"]:
        body["max_tokens"] = 64
        return route, body, "hang_up"
    return route, body, "ok"


async def send(client: httpx.AsyncClient, route: str, body: dict, expect: str) -> str:
    """Returns what happened: "ok", "bad" (a 400 as expected), "hung_up", or an error."""
    if body["stream"]:
        async with client.stream("POST", route, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return "bad" if r.status_code == 400 and expect == "bad" else f"{r.status_code}"
            lines = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines += 1
                    if '"error"' in line:
                        return f"stream error {line[:200]}"
                    if expect == "hang_up" and lines >= 3:
                        return "hung_up"  # leaving the block closes the connection
            return "ok"
    r = await client.post(route, json=body)
    if r.status_code == 400 and expect == "bad":
        return "bad"
    return "ok" if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"


async def drive(url: str, pid: int, args) -> dict:
    rng = random.Random(args.seed)
    requests = [make_request(rng, i) for i in range(args.num_requests)]
    process = psutil.Process(pid)
    rss: list[tuple[int, float]] = []
    outcomes: dict[str, int] = {}
    done = 0
    queue = iter(enumerate(requests))
    start = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        for _, (route, body, expect) in queue:
            outcome = await send(client, route, body, expect)
            if outcome not in ("ok", "bad", "hung_up") or (outcome == "bad") != (expect == "bad"):
                print(f"unexpected: {outcome} for {route} {json.dumps(body)[:200]}", flush=True)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            done += 1
            if done % 500 == 0:
                rss.append((done, process.memory_info().rss / 2**20))
                rate = done / (time.perf_counter() - start)
                print(
                    f"{done:>6} requests, {rate:5.1f} req/s, server RSS {rss[-1][1]:,.0f} MiB",
                    flush=True,
                )

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    duration = time.perf_counter() - start
    return {"rss_mib": rss, "outcomes": outcomes, "duration_s": duration}


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=500_000_000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG: server RSS against requests served")
    parser.add_argument("serve_args", nargs="*", help="extra `pagoda serve` flags (after --)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve"]
    cmd += [args.model] if args.model else []
    cmd += ["--port", str(port), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    cmd += ["--disable-uvicorn-access-log", *args.serve_args]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pagoda serve did not start: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        result = asyncio.run(drive(url, server.pid, args))
        time.sleep(1.0)  # hung-up requests are aborted as their connections close
        blocks_used = metric(url, "pagoda:num_blocks_used")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    rss = dict(result["rss_mib"])
    first = rss.get(2000, result["rss_mib"][0][1])
    last_n, last = result["rss_mib"][-1]
    growth = last / first - 1
    per_request_kib = (last - first) * 1024 / max(1, last_n - 2000)
    good = sum(v for k, v in result["outcomes"].items() if k in ("ok", "bad", "hung_up"))
    passed = abs(growth) <= 0.05 and good == args.num_requests and blocks_used == 0
    print(
        f"\n{args.num_requests} requests in {result['duration_s']:.0f} s; outcomes {result['outcomes']}\n"
        f"server RSS {first:,.0f} MiB after 2,000 -> {last:,.0f} MiB after {last_n:,} "
        f"({growth:+.1%}, {per_request_kib:+.2f} KiB per request); KV blocks in use at the end: "
        f"{blocks_used:.0f}\n{'PASS' if passed else 'FAIL'} (RSS within 5%, every request answered "
        "as expected, no block held)"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "config": vars(args),
                    "machine": {
                        "cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(),
                    },
                    **result,
                    "rss_growth": growth,
                    "blocks_used_at_end": blocks_used,
                    "passed": passed,
                },
                f,
                indent=1,
            )
    if args.plot:
        from pagoda.bench.report import _pyplot, _save

        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs, ys = zip(*result["rss_mib"], strict=True)
        ax.plot(xs, ys, marker=".")
        ax.axhspan(first * 0.95, first * 1.05, alpha=0.15, label="within 5% of RSS after 2,000")
        ax.set_xlabel("requests served")
        ax.set_ylabel("server RSS (MiB)")
        ax.legend(loc="lower right")
        title = f"pagoda serve, {args.num_requests:,} short requests, {args.concurrency} in flight"
        _save(plt, fig, args.plot, title)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
