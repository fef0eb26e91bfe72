"""What a connected /dashboard costs the engine, and the dashboard's screenshot.

One `pagoda serve` (default model unless --model), then `--rounds` rounds of
`pagoda bench serve --workload mixed` (64 requests, all at t=0), each round once
with no dashboard and once with a dashboard feed connected (a plain SSE reader in
this process, so the browser's own rendering does not share the 2 cores with the
server), the order alternating between rounds. Reported per mode: output tok/s
and mean TPOT (medians over rounds), and from the feed itself, the engine-thread
time each sample took (`snapshot_ms`) as a fraction of the sampling interval.
Then, with --screenshot, one more loaded pass with headless Chromium on the page,
captured mid-run.

    python benchmarks/dashboard.py --rounds 3 --screenshot docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def start_server(model: str | None, port: int, interval: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *([model] if model else [])]
    cmd += ["--port", str(port), "--dashboard-interval", str(interval)]
    cmd += ["--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


class Feed:
    """Reads /dashboard/events in a thread and keeps each sample's snapshot_ms."""

    def __init__(self, url: str) -> None:
        self.snapshot_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()

    def _read(self, url: str) -> None:
        with httpx.stream("GET", url + "/dashboard/events", timeout=None) as response:
            kind = None
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: ") and kind == "sample":
                    self.snapshot_ms.append(json.loads(line[6:])["snapshot_ms"])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def bench(url: str, out_json: str, num_prompts: int) -> dict:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "serve", "--base-url", url]
    cmd += ["--workload", "mixed", "--num-prompts", str(num_prompts), "--no-progress"]
    cmd += ["--no-kv-sampling", "--output-json", out_json]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(out_json) as f:
        (result,) = json.load(f)["results"]
    return result


def screenshot(url: str, path: str, num_prompts: int, out_json: str) -> None:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=args)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(url + "/dashboard")
        load = threading.Thread(target=bench, args=(url, out_json, num_prompts))
        load.start()
        page.wait_for_function(
            "Number(document.getElementById('running-count').textContent) >= 16", timeout=120_000
        )
        time.sleep(8)  # let the charts fill
        page.screenshot(path=path, full_page=False)
        load.join()
        browser.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model to serve (default: pagoda's default)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--interval", type=float, default=0.5, help="--dashboard-interval")
    ap.add_argument("--screenshot", default=None, help="PNG of the page under load")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    url = f"http://127.0.0.1:{ns.port}"
    proc = start_server(ns.model, ns.port, ns.interval)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    snapshot_ms: list[float] = []
    tmp = tempfile.mkdtemp()
    try:
        bench(url, os.path.join(tmp, "warmup.json"), 8)
        for i in range(ns.rounds):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                feed = Feed(url) if mode == "on" else None
                result = bench(url, os.path.join(tmp, f"{mode}{i}.json"), ns.num_prompts)
                if feed is not None:
                    feed.close()
                    snapshot_ms += feed.snapshot_ms
                runs[mode].append(result)
                print(
                    f"round {i + 1} dashboard {mode:>3}: {result['output_throughput']:7.1f} "
                    f"out tok/s, TPOT mean {result['tpot_ms']['mean']:6.2f} ms",
                    flush=True,
                )
        if ns.screenshot:
            screenshot(url, ns.screenshot, ns.num_prompts, os.path.join(tmp, "shot.json"))
    finally:
        proc.terminate()
        proc.wait(60)
    med = {
        mode: (
            statistics.median(r["output_throughput"] for r in rs),
            statistics.median(r["tpot_ms"]["mean"] for r in rs),
        )
        for mode, rs in runs.items()
    }
    print(f"\nmixed, {ns.num_prompts} requests, {ns.rounds} rounds (medians):")
    for mode, (tps, tpot) in med.items():
        print(f"  dashboard {mode:>3}: {tps:7.1f} out tok/s, TPOT mean {tpot:6.2f} ms")
    print(
        f"  on / off: throughput {med['on'][0] / med['off'][0]:.3f}x, "
        f"TPOT {med['on'][1] / med['off'][1]:.3f}x"
    )
    if snapshot_ms:
        mean = statistics.mean(snapshot_ms)
        print(
            f"  snapshots: {len(snapshot_ms)}, mean {mean:.3f} ms, max {max(snapshot_ms):.3f} ms "
            f"= {100 * mean / (1000 * ns.interval):.3f}% of the engine thread at one per "
            f"{ns.interval} s"
        )
    if ns.output_json:
        from pagoda.bench.report import machine_info

        result = {
            "command": " ".join(["python", *sys.argv]), "machine": machine_info(),
            "rounds": ns.rounds, "num_prompts": ns.num_prompts, "interval_s": ns.interval,
            "median": {m: {"output_throughput": t, "tpot_ms_mean": p} for m, (t, p) in med.items()},
            "runs": {m: [r["output_throughput"] for r in rs] for m, rs in runs.items()},
            "snapshot_ms": {"count": len(snapshot_ms), "mean": statistics.mean(snapshot_ms),
                            "max": max(snapshot_ms)} if snapshot_ms else None,
        }  # fmt: skip
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
