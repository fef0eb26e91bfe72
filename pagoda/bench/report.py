"""Tables, JSON files (with machine and versions) and plots for benchmark results."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for results that name their machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import psutil

    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
    }
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


def versions() -> dict[str, str]:
    import torch
    import transformers

    import pagoda

    return {
        "pagoda": pagoda.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "torch_threads": str(torch.get_num_threads()),
    }


def write_json(path: str, config: dict[str, Any], results: list[dict[str, Any]]) -> None:
    doc = {
        "command": " ".join(sys.argv),
        "config": config,
        "machine": machine_info(),
        "versions": versions(),
        "results": results,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)


def format_table(results: list[dict[str, Any]], baseline: str | None = None) -> str:
    """One row per system; `x base` is output tok/s relative to the baseline system."""
    base = next((r for r in results if r["system"] == baseline), None)
    header = (
        f"{'system':<22}{'wall s':>8}{'req/s':>8}{'out tok/s':>11}{'tot tok/s':>11}{'x base':>8}"
        + f"{'TTFT mean':>11}{'TTFT p99':>10}{'TPOT mean':>11}{'TPOT p99':>10}{'RSS MiB':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        ratio = (
            r["output_throughput"] / base["output_throughput"]
            if base and base["output_throughput"]
            else float("nan")
        )
        lines.append(
            f"{r['system']:<22}{r['duration_s']:>8.1f}{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}"
            f"{r['total_token_throughput']:>11.1f}{ratio:>8.2f}{r['ttft_ms']['mean']:>11.0f}{r['ttft_ms']['p99']:>10.0f}"
            f"{r['tpot_ms']['mean']:>11.1f}{r['tpot_ms']['p99']:>10.1f}{r.get('peak_rss_mib', 0):>9.0f}"
        )
    kv = [r for r in results if "kv_efficiency_paged" in r]
    if kv:
        lines.append("")
        lines.append("KV memory efficiency (tokens held / KV memory reserved), mean over steps:")
        for r in kv:
            lines.append(
                f"  {r['system']:<20} paged {100 * r['kv_efficiency_paged']:5.1f}%   contiguous max_model_len "
                f"{100 * r['kv_efficiency_contiguous_max_len']:5.1f}%   contiguous prompt+max_tokens "
                f"{100 * r['kv_efficiency_contiguous_exact']:5.1f}%   peak blocks {r['kv_blocks_peak']}/{r['kv_blocks_total']}"
            )
    return "\n".join(lines)


def _pyplot():
    """matplotlib without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare(path: str, results: list[dict[str, Any]], title: str) -> None:
    plt = _pyplot()
    names = [r["system"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("output tokens/s (higher is better)", [r["output_throughput"] for r in results]),
        ("TTFT p99, s (lower is better)", [r["ttft_ms"]["p99"] / 1000 for r in results]),
        ("TPOT p99, ms (lower is better)", [r["tpot_ms"]["p99"] for r in results]),
    ]
    colors = ["#2b6cb0" if n.startswith("pagoda-continuous") else "#a0aec0" for n in names]
    for ax, (label, values) in zip(axes, panels, strict=True):
        bars = ax.bar(names, values, color=colors)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    _save(plt, fig, path, title)


def _axes(plt, results: list[dict[str, Any]]):
    """Two panels, and a third for KV cache usage over time when a run sampled it."""
    with_kv = any(r.get("kv_usage") for r in results)
    fig, axes = plt.subplots(1, 3 if with_kv else 2, figsize=(18 if with_kv else 12, 4.5))
    if with_kv:
        ax = axes[2]
        for r in results:
            if r.get("kv_usage"):
                t, usage = zip(*r["kv_usage"], strict=True)
                label = r["system"] + (f" rate {r['request_rate']}" if "request_rate" in r else "")
                ax.plot(t, usage, label=label)
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("KV cache used (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend()
    return fig, axes


def plot_sweep(path: str, series: dict[str, list[dict[str, Any]]], title: str) -> None:
    """One line per system: throughput vs P99 TTFT and vs P99 TPOT across request rates
    (and KV cache usage over each run, when sampled)."""
    plt = _pyplot()
    fig, axes = _axes(plt, [p for points in series.values() for p in points])
    for name, points in series.items():
        thr = [p["output_throughput"] for p in points]
        axes[0].plot(thr, [p["ttft_ms"]["p99"] for p in points], marker="o", label=name)
        axes[1].plot(thr, [p["tpot_ms"]["p99"] for p in points], marker="o", label=name)
    for ax, label in zip(axes[:2], ("P99 TTFT (ms)", "P99 TPOT (ms)"), strict=True):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    _save(plt, fig, path, title)


def plot_latency_cdf(path: str, results: list[dict[str, Any]], title: str) -> None:
    """One line per result: the CDF of per-request TTFT and of TPOT (from `per_request`),
    and KV cache usage over the run, when sampled."""
    plt = _pyplot()
    fig, axes = _axes(plt, results)
    for r in results:
        for ax, key in zip(axes[:2], ("ttft_ms", "tpot_ms"), strict=True):
            values = sorted(v for v in r.get("per_request", {}).get(key, []) if v is not None)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, fractions, drawstyle="steps-post", label=r["system"])
    for ax, label in zip(axes[:2], ("TTFT (ms)", "TPOT (ms)"), strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(plt, fig, path, title)


def plot_roofline(
    path: str, limits: dict[str, Any], rows: list[dict[str, Any]], title: str
) -> None:
    """The roofline (log-log): GFLOP/s against arithmetic intensity (FLOP per byte read),
    one roof per peak (the read-bandwidth slope up to the peak's flat line), each phase a
    point, drawn in its path's color, labeled with its fraction of its own roof."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    bandwidth = limits["read_gbs"]  # GB/s: GFLOP/s per FLOP/byte
    peaks = dict(limits["peaks_gflops"])
    if limits.get("bf16_no_amx_gflops"):
        peaks["bf16 no AMX"] = limits["bf16_no_amx_gflops"]
    ridges = [p / bandwidth for p in peaks.values()]
    intensities = [r["intensity"] for r in rows]
    x = np.geomspace(min(intensities + ridges) / 4, max(intensities + ridges) * 4, 400)
    colors = dict(zip(peaks, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    used = {r["path"] for r in rows}  # the roofs no phase is held to: thin and dashed
    for name, peak in peaks.items():
        unit = "GOP/s" if name == "int8" else "GFLOP/s"
        style = {"lw": 2.0} if name in used else {"lw": 1.0, "ls": "--"}
        ax.plot(x, np.minimum(bandwidth * x, peak), color=colors[name], **style,
                label=f"{name}: {peak:,.0f} {unit}, {bandwidth:.1f} GB/s")  # fmt: skip
    for r in rows:
        ax.scatter(r["intensity"], r["achieved_gflops"], color=colors[r["path"]], zorder=3)
        label = f"{r['phase']} {r['rows']}: {100 * r['fraction']:.0f}%"
        ax.annotate(label, (r["intensity"], r["achieved_gflops"]), fontsize=8,
                    textcoords="offset points", xytext=(5, -10))  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("GFLOP/s (int8: GOP/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    _save(plt, fig, path, title)
