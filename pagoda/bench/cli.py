"""`pagoda bench throughput | latency | roofline | serve | profile`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagoda.bench.workloads import WORKLOADS


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def register(sub: argparse._SubParsersAction) -> None:
    from pagoda.entrypoints.arg_utils import add_engine_args

    bench = sub.add_parser("bench", help="benchmarks against peers (throughput, latency, serving)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    thr = bsub.add_parser("throughput", help="offline throughput, pagoda vs peers")
    thr.add_argument("--model", default=None)
    thr.add_argument("--workload", choices=WORKLOADS, default="mixed")
    thr.add_argument("--dataset", default=None, help="JSONL of prompts (and optional output_len)")
    thr.add_argument("--num-prompts", type=int, default=None)
    thr.add_argument("--workload-seed", type=int, default=42, help="seed of the synthetic workload")
    thr.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals (req/s)"
    )
    thr.add_argument("--backend", choices=("pagoda", "hf"), default="pagoda")
    thr.add_argument(
        "--batching", choices=("continuous", "dynamic", "static"), default="continuous"
    )
    thr.add_argument("--batch-size", type=int, default=64, help="static/dynamic batch size")
    thr.add_argument(
        "--max-queue-delay", type=float, default=0.05, help="dynamic batching: seconds"
    )
    thr.add_argument("--hf-batch-sizes", type=_ints, default=[8, 16, 32, 64])
    thr.add_argument(
        "--compare", action="store_true", help="pagoda's three modes and HF, with ratios"
    )
    thr.add_argument("--output-json", default=None)
    thr.add_argument("--plot", default=None, help="PNG bar chart (with --compare)")
    thr.add_argument("--no-progress", action="store_true")
    add_engine_args(thr)
    thr.set_defaults(func=cmd_throughput)

    lat = bsub.add_parser("latency", help="per-step prefill and decode latency by batch size")
    lat.add_argument("--model", default=None)
    lat.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 64])
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=32)
    lat.add_argument("--output-json", default=None)
    add_engine_args(lat)
    lat.set_defaults(func=cmd_latency)

    roof = bsub.add_parser(
        "roofline",
        help="each phase (prefill, decode by batch) as a fraction of this machine's limit",
    )
    roof.add_argument("--model", default=None)
    roof.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16, 64])
    roof.add_argument("--context-len", type=int, default=256, help="decode steps' mean context")
    roof.add_argument("--prefill-tokens", type=int, default=512, help="the prefill chunk")
    roof.add_argument("--decode-steps", type=int, default=8, help="timed steps per batch size")
    roof.add_argument(
        "--quick", action="store_true", help="fewer repeats, a 256 MiB bandwidth read"
    )
    roof.add_argument("--output-json", default=None)
    roof.add_argument("--plot", default=None, help="PNG roofline chart")
    add_engine_args(roof)
    roof.set_defaults(func=cmd_roofline)

    prof = bsub.add_parser(
        "profile", help="fit the simulator's step cost model to this machine's engine steps"
    )
    prof.add_argument("--model", default=None)
    prof.add_argument("--output-json", default="cost_model.json", help="where the model goes")
    prof.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts")
    prof.add_argument("--no-progress", action="store_true")
    add_engine_args(prof)
    prof.set_defaults(func=cmd_profile)

    try:
        from pagoda.bench.serve import add_serve_bench_args
    except ImportError:  # pragma: no cover - arrives with the serving benchmark
        return
    srv = bsub.add_parser(
        "serve", help="online serving benchmark against any OpenAI-compatible URL"
    )
    add_serve_bench_args(srv)


def _engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    from pagoda.entrypoints.arg_utils import engine_args_from

    return dataclasses.asdict(engine_args_from(ns))


def _workload(ns: argparse.Namespace, engine_kwargs: dict[str, Any]):
    from pagoda.bench.workloads import load_dataset, make_workload
    from pagoda.model_executor.model_files import load_tokenizer, resolve_model

    path, is_gguf = resolve_model(engine_kwargs["model"])
    tokenizer = load_tokenizer(path, is_gguf)
    if ns.dataset:
        reqs = load_dataset(ns.dataset, tokenizer)
        if ns.num_prompts:
            reqs = reqs[: ns.num_prompts]
    else:
        reqs = make_workload(
            ns.workload,
            tokenizer,
            seed=ns.workload_seed,
            num_prompts=ns.num_prompts,
            request_rate=ns.request_rate,
        )
    return reqs, path, is_gguf


def cmd_throughput(ns: argparse.Namespace) -> int:
    from pagoda.bench import report
    from pagoda.bench.throughput import in_subprocess

    engine_kwargs = _engine_kwargs(ns)
    reqs, path, is_gguf = _workload(ns, engine_kwargs)
    from pagoda import EngineArgs

    device = EngineArgs(**engine_kwargs).resolved_device()
    dtype = engine_kwargs["dtype"]
    if dtype == "auto":
        from pagoda.model_executor.model_loader import resolve_dtype

        dtype = resolve_dtype("auto", {}, device)
    progress = not ns.no_progress
    results = []

    def pagoda_run(batching: str) -> dict[str, Any]:
        return in_subprocess(
            "run_pagoda",
            engine_kwargs=engine_kwargs,
            reqs=reqs,
            batching=batching,
            batch_size=ns.batch_size,
            max_queue_delay=ns.max_queue_delay,
            progress=progress,
        )

    def hf_runs() -> list[dict[str, Any]]:
        runs = [
            in_subprocess(
                "run_hf",
                model_path=path,
                is_gguf=is_gguf,
                dtype=dtype,
                reqs=reqs,
                batch_size=b,
                progress=progress,
                device=device,
            )
            for b in ns.hf_batch_sizes
        ]
        best = max(runs, key=lambda r: r["output_throughput"])
        best["best_of"] = [r["batch_size"] for r in runs]
        return runs

    baseline = None
    if ns.compare:
        results += [pagoda_run(m) for m in ("continuous", "dynamic", "static")]
        hf = hf_runs()
        results += hf
        baseline = max(hf, key=lambda r: r["output_throughput"])["system"]
    elif ns.backend == "hf":
        results += hf_runs()
    else:
        results.append(pagoda_run(ns.batching))
    label = ns.dataset or ns.workload
    print(
        f"\nworkload {label}: {len(reqs)} requests, {sum(r.output_len for r in reqs)} output tokens, dtype {dtype}"
    )
    print(report.format_table(results, baseline))
    config = {
        "workload": label,
        "num_requests": len(reqs),
        "dtype": dtype,
        "device": device,
        "engine": engine_kwargs,
        "batch_size": ns.batch_size,
        "hf_batch_sizes": ns.hf_batch_sizes,
    }
    if ns.output_json:
        report.write_json(ns.output_json, config, results)
    if ns.plot:
        report.plot_compare(ns.plot, results, f"{label}, {len(reqs)} requests, {dtype}")
    return 0


def cmd_profile(ns: argparse.Namespace) -> int:
    from pagoda.bench.profile import profile

    engine_kwargs = _engine_kwargs(ns)
    model = profile(engine_kwargs, seed=ns.workload_seed, progress=not ns.no_progress)
    model.to_json(ns.output_json)
    fit = model.source
    print(
        f"{fit['steps']} steps fitted: mean error {100 * fit['mean_abs_error']:.1f}%, "
        f"p90 {100 * fit['p90_abs_error']:.1f}%; written to {ns.output_json}"
    )
    return 0


def cmd_latency(ns: argparse.Namespace) -> int:
    from pagoda.bench import report
    from pagoda.bench.latency import format_latency, run_latency

    engine_kwargs = _engine_kwargs(ns)
    rows = run_latency(engine_kwargs, ns.batch_sizes, ns.input_len, ns.output_len)
    print(format_latency(rows))
    if ns.output_json:
        report.write_json(
            ns.output_json,
            {"engine": engine_kwargs, "input_len": ns.input_len, "output_len": ns.output_len},
            rows,
        )
    return 0


def cmd_roofline(ns: argparse.Namespace) -> int:
    from pagoda.bench import report
    from pagoda.bench.roofline import format_roofline, run_roofline

    engine_kwargs = _engine_kwargs(ns)
    found, rows = run_roofline(
        engine_kwargs,
        ns.batch_sizes,
        ns.context_len,
        ns.prefill_tokens,
        decode_steps=ns.decode_steps,
        repeats=2 if ns.quick else 3,
        read_bytes=(256 if ns.quick else 1024) << 20,
    )
    print(format_roofline(found, rows))
    config = {
        "engine": engine_kwargs,
        "batch_sizes": ns.batch_sizes,
        "context_len": ns.context_len,
        "prefill_tokens": ns.prefill_tokens,
        "decode_steps": ns.decode_steps,
        **found,
    }
    if ns.output_json:
        report.write_json(ns.output_json, config, rows)
    if ns.plot:
        model = engine_kwargs["model"] or "default model"
        report.plot_roofline(ns.plot, found["limits"], rows, f"{model}, {found['limits']['cpu']}")
    return 0
