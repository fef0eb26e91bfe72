"""`pagoda bench serve`: an online serving benchmark against any OpenAI-compatible URL.

It speaks only HTTP (OpenAI's streaming API plus vLLM's `ignore_eos`), so the
same client measures pagoda, vLLM and llama.cpp's server. Requests arrive as a
Poisson process at `--request-rate` (all at t=0 for `inf`), at most
`--max-concurrency` in flight; each asks for exactly its output length
(`max_tokens` and `ignore_eos`), greedily, streamed with a final usage chunk.

Timing, all on the client's `perf_counter` clock:
- a request's clock starts at its scheduled arrival. A request that waits for a
  free `--max-concurrency` slot has that wait in its TTFT and E2EL, as its user
  would (vLLM's benchmark starts at the send instead); `client_wait_ms` reports
  the wait alone, and `ttft_after_send_ms` the TTFT from the send;
- a token time is taken for every streamed chunk that carries text, so ITL is
  the gap between such chunks. The output token count comes from the usage
  chunk, or, from a server that sends none, from re-tokenizing the streamed
  text. TPOT = (E2EL - TTFT) / (tokens - 1), as vLLM defines it;
- a request fails on an HTTP error, an error event in the stream, a broken
  connection or a timeout; failures are counted, never averaged in. A 429 (a
  server shedding what it cannot serve in time, e.g. pagoda with --slo-ttft-ms)
  counts as `refused`, apart from the failures: never good, so goodput is over
  every request sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import random
import time
from collections import Counter
from typing import Any

from pagoda.bench.client import StreamResult, sample_kv_usage, stream_request
from pagoda.bench.metrics import RequestTimeline, compute_metrics, summarize
from pagoda.bench.workloads import WORKLOADS, BenchRequest, assign_poisson_arrivals

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive (or inf), got {text!r}")
    return rates


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    p.add_argument("--model", default=None, help="served model name (default: GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model folder or .gguf whose tokenizer makes the prompts (default: pagoda's default)",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="online")
    p.add_argument("--dataset", default=None, help="JSONL of prompts (and optional output_len)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument(
        "--prompt-ids", action="store_true", help="send token-id lists (completions only)"
    )
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson)")
    p.add_argument("--sweep", type=_rates, default=None, help="rates, one pass each: 1,2,4,inf")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT objective")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT objective")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into requests")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--label", default=None, help="system name in the table, JSON and plot")
    p.add_argument("--include-json", action="append", default=[], help="earlier results to add")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: latency vs throughput (sweep) or CDFs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--no-kv-sampling",
        action="store_true",
        help="do not scrape the server's /metrics for KV cache usage during the run",
    )
    p.set_defaults(func=cmd_serve)


# ---- one pass at one rate -------------------------------------------------------------------


def make_payloads(
    reqs: list[BenchRequest],
    tokenizer,
    endpoint: str,
    model: str,
    prompt_ids: bool,
    extra_body: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """Request bodies asking for exactly `output_len` greedy tokens, with usage at the end."""
    payloads = []
    for r in reqs:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": r.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text = r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids)
        if endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = list(r.prompt_token_ids) if prompt_ids else text
        payloads.append({**body, **(extra_body or {})})
    return payloads


async def _run_pass_async(
    url: str,
    headers: dict[str, str],
    payloads: list[dict[str, Any]],
    arrivals: list[float],
    chat: bool,
    max_concurrency: int | None,
    timeout: float,
    bar,
    metrics_url: str | None,
    kv_usage: list,
) -> tuple[list[StreamResult], float, float]:
    import httpx

    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency
    )
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=httpx.Timeout(timeout, pool=None)
    ) as client:
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

        async def one(i: int) -> StreamResult:
            async with gate:
                res = await stream_request(client, url, payloads[i], chat)
            bar.update(1)
            return res

        tasks: dict[int, asyncio.Task] = {}
        start = time.perf_counter()
        sampler = None
        if metrics_url is not None:  # its own connection: never waits for a request slot
            metrics_client = httpx.AsyncClient(headers=headers, timeout=10)
            sampler = asyncio.create_task(
                sample_kv_usage(metrics_client, metrics_url, start, kv_usage)
            )
        for i in sorted(range(len(payloads)), key=arrivals.__getitem__):
            delay = start + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks[i] = asyncio.create_task(one(i))
        results = [await tasks[i] for i in range(len(payloads))]
        duration = time.perf_counter() - start
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            await metrics_client.aclose()
        return results, start, duration


def run_pass(
    url: str,
    payloads: list[dict[str, Any]],
    reqs: list[BenchRequest],
    tokenizer,
    chat: bool,
    *,
    headers: dict[str, str] | None = None,
    max_concurrency: int | None = None,
    timeout: float = 3600.0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    progress: bool = True,
    desc: str = "",
    metrics_url: str | None = None,
) -> dict[str, Any]:
    """Send `payloads[i]` at `reqs[i].arrival_time` seconds; return compute_metrics()'s
    dict plus the received token counts, the client-side wait and the errors seen, and
    with `metrics_url`, the server's KV cache usage over the run (`kv_usage`: pairs of
    seconds and percent; `kv_usage_peak`)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(payloads), desc=desc, disable=not progress, dynamic_ncols=True)
    arrivals = [r.arrival_time for r in reqs]
    kv_usage: list[tuple[float, float]] = []
    results, start, duration = asyncio.run(
        _run_pass_async(
            url,
            headers or {},
            payloads,
            arrivals,
            chat,
            max_concurrency,
            timeout,
            bar,
            metrics_url,
            kv_usage,
        )
    )
    bar.close()
    timelines = []
    for r, res in zip(reqs, results, strict=True):
        n = res.completion_tokens
        if n is None and res.error is None:
            n = len(tokenizer.encode(res.text, add_special_tokens=False))
        timelines.append(
            RequestTimeline(
                arrival=start + r.arrival_time,
                token_times=res.chunk_times,
                prompt_len=res.prompt_tokens or len(r.prompt_token_ids),
                output_len=n or 0,
                success=res.error is None,
                refused=res.refused,
                num_tokens=n,
            )
        )
    metrics = compute_metrics(timelines, duration, slo_ttft_ms, slo_tpot_ms)
    ok = [(r, t) for r, t in zip(reqs, timelines, strict=True) if t.success]
    metrics.update(
        output_tokens=sum(t.output_len for _, t in ok),
        output_tokens_requested=sum(r.output_len for r, _ in ok),
        output_len_mismatches=sum(t.output_len != r.output_len for r, t in ok),
        client_wait_ms=summarize(
            [res.send_time - t.arrival for res, t in zip(results, timelines, strict=True)]
        ),
        # The server's share of TTFT: from the send, without the wait for a slot.
        ttft_after_send_ms=summarize(
            [res.chunk_times[0] - res.send_time for res in results if res.chunk_times]
        ),
        errors=dict(
            Counter(res.error for res in results if res.error and not res.refused).most_common(5)
        ),
        retry_after_s=summarize([r.retry_after for r in results if r.retry_after], scale=1.0),
    )
    if kv_usage:
        metrics.update(kv_usage=kv_usage, kv_usage_peak=max(u for _, u in kv_usage))
    return metrics


# ---- the command --------------------------------------------------------------------------


def _served_model(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The first model card of GET /v1/models."""
    import httpx

    try:
        resp = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(
            f"cannot list the models at {base_url}/v1/models ({e}); pass --model."
        ) from e


def _requests(ns: argparse.Namespace, tokenizer, max_model_len: int | None) -> list[BenchRequest]:
    from pagoda.bench.workloads import load_dataset, make_workload

    if ns.dataset:
        reqs = load_dataset(ns.dataset, tokenizer)
        return reqs[: ns.num_prompts] if ns.num_prompts else reqs
    return make_workload(
        ns.workload,
        tokenizer,
        seed=ns.seed,
        num_prompts=ns.num_prompts,
        max_model_len=max_model_len,
    )


def _validate(ns: argparse.Namespace) -> None:
    if ns.prompt_ids and ns.endpoint != "/v1/completions":
        raise ValueError("--prompt-ids needs --endpoint /v1/completions.")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}.")
    if ns.num_prompts is not None and ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}.")
    if not ns.request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {ns.request_rate}.")


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_serve_table(results: list[dict[str, Any]]) -> str:
    """One row per system and request rate (latencies in ms)."""
    header = (
        f"{'system':<18}{'rate':>6}{'ok':>6}{'429':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>11}"
        f"{'goodput':>9}"
        f"{'TTFT mean':>11}{'p50':>8}{'p99':>8}{'TPOT mean':>11}{'p99':>8}{'ITL p99':>9}"
        f"{'E2EL mean':>11}{'p99':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        ttft, tpot, itl, e2el = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2el_ms"]
        lines.append(
            f"{r['system']:<18}{r.get('request_rate', '')!s:>6}{r['completed']:>6}"
            f"{r.get('refused', 0):>5}{r['failed']:>5}"
            f"{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}{r['goodput']:>9.2f}"
            f"{ttft['mean']:>11.1f}{ttft['median']:>8.1f}{ttft['p99']:>8.1f}"
            f"{tpot['mean']:>11.2f}{tpot['p99']:>8.2f}{itl['p99']:>9.2f}"
            f"{e2el['mean']:>11.1f}{e2el['p99']:>8.1f}"
        )
    return "\n".join(lines)


def cmd_serve(ns: argparse.Namespace) -> int:
    from pagoda.bench import report
    from pagoda.model_executor.model_files import load_tokenizer, resolve_model

    _validate(ns)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    base_url = ns.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    card = {"id": ns.model} if ns.model else _served_model(base_url, headers)
    model = card["id"]
    label = ns.label or model
    tokenizer = load_tokenizer(*resolve_model(ns.tokenizer))
    base_reqs = _requests(ns, tokenizer, card.get("max_model_len"))
    chat = ns.endpoint == "/v1/chat/completions"
    payloads = make_payloads(base_reqs, tokenizer, ns.endpoint, model, ns.prompt_ids, ns.extra_body)
    url = base_url + ns.endpoint

    check = run_pass(
        url,
        [{**payloads[0], "max_tokens": 2}],
        [copy.copy(base_reqs[0])],
        tokenizer,
        chat,
        headers=headers,
        timeout=ns.request_timeout,
        progress=False,
    )
    if check["failed"]:
        raise ValueError(f"the test request to {url} failed: {next(iter(check['errors']))}")

    results = []
    for rate in ns.sweep or [ns.request_rate]:
        reqs = [copy.copy(r) for r in base_reqs]
        assign_poisson_arrivals(reqs, rate, random.Random(ns.seed))
        result = run_pass(
            url,
            payloads,
            reqs,
            tokenizer,
            chat,
            headers=headers,
            max_concurrency=ns.max_concurrency,
            timeout=ns.request_timeout,
            slo_ttft_ms=ns.slo_ttft_ms,
            slo_tpot_ms=ns.slo_tpot_ms,
            progress=not ns.no_progress,
            desc=f"{label} rate {_rate_text(rate)}",
            metrics_url=None if ns.no_kv_sampling else base_url + "/metrics",
        )
        result.update(
            system=label, request_rate=_rate_text(rate), max_concurrency=ns.max_concurrency
        )
        results.append(result)

    for path in ns.include_json:
        with open(path) as f:
            results += json.load(f)["results"]
    source = ns.dataset or ns.workload
    print(
        f"\n{source}: {len(base_reqs)} requests, {sum(r.output_len for r in base_reqs)} output "
        f"tokens each pass, {url} ({model})"
    )
    print(format_serve_table(results))
    for r in results:
        if r.get("errors"):
            print(f"{r['system']} rate {r['request_rate']}: errors {r['errors']}")
        if r.get("refused"):
            wait = r["retry_after_s"]["median"]
            print(
                f"{r['system']} rate {r['request_rate']}: {r['refused']} refused (429, never "
                f"good), Retry-After median {wait:g} s"
            )
        if r.get("kv_usage_peak") is not None:
            print(
                f"{r['system']} rate {r['request_rate']}: KV cache peak {r['kv_usage_peak']:.1f}%"
            )
    config = {
        "base_url": base_url,
        "endpoint": ns.endpoint,
        "model": model,
        "label": label,
        "tokenizer": ns.tokenizer,
        "workload": source,
        "num_requests": len(base_reqs),
        "request_rates": [_rate_text(r) for r in ns.sweep or [ns.request_rate]],
        "max_concurrency": ns.max_concurrency,
        "prompt_ids": ns.prompt_ids,
        "seed": ns.seed,
        "slo_ttft_ms": ns.slo_ttft_ms,
        "slo_tpot_ms": ns.slo_tpot_ms,
        "extra_body": ns.extra_body,
    }
    if ns.output_json:
        report.write_json(ns.output_json, config, results)
    if ns.plot:
        title = f"{source}, {len(base_reqs)} requests, {ns.endpoint}"
        series: dict[str, list[dict[str, Any]]] = {}
        for r in results:
            series.setdefault(r["system"], []).append(r)
        if any(len(points) > 1 for points in series.values()):
            report.plot_sweep(ns.plot, series, title)
        else:
            report.plot_latency_cdf(ns.plot, results, title)
    return 0
