"""Speculative decoding (n-gram, and a draft model) on and off, same workloads, one command.

    python benchmarks/speculative.py [--model M] [--output-json docs/perf/speculative.json]

- `grounded` at batch 1 (max_num_seqs 1: one request at a time), in the model's
  GGUF format and expanded to bf16 (`--quantization none`): output tok/s with
  and without speculation, and whether the greedy outputs are identical;
- `grounded` at larger batches (max_num_seqs B), speculating whatever the batch
  size: where it stops paying, which is what `disable_by_batch_size` encodes;
- `mixed` with 64 in flight, speculation on vs off (it switches itself off at
  `disable_by_batch_size` running requests; this shows what that leaves);
- with `--draft` (GGUF models): the bf16 expansion with the file's own blocks as
  its draft model (`{"method": "draft"}`), grounded and `chat` prompts at batch 1,
  and `mixed` at 64 in flight with it on (the draft's KV pool halves the blocks).

Each run is its own process (pagoda.bench.throughput.run_pagoda). Figures are
ratios within this one command; name the CPU with them.
"""

from __future__ import annotations

import argparse
import json

from pagoda.bench.report import machine_info, versions
from pagoda.bench.throughput import in_subprocess
from pagoda.bench.workloads import make_workload
from pagoda.model_executor.model_files import load_tokenizer, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--grounded-prompts", type=int, default=16)
    parser.add_argument("--batch-sizes", default="2,4,8", help="grounded, speculating always")
    parser.add_argument("--draft", action="store_true", help="also a draft model (GGUF)")
    parser.add_argument("--skip-ngram", action="store_true", help="only the draft-model runs")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    path, is_gguf = resolve_model(ns.model)
    tokenizer = load_tokenizer(path, is_gguf)
    spec = {"method": "ngram", "num_speculative_tokens": ns.num_speculative_tokens}
    grounded = make_workload("grounded", tokenizer, num_prompts=ns.grounded_prompts)
    mixed = make_workload("mixed", tokenizer)
    rows = []

    def run(workload: str, reqs, label: str, **engine_kwargs) -> dict:
        engine_kwargs = {"model": ns.model, **engine_kwargs}
        result = in_subprocess("run_pagoda", engine_kwargs=engine_kwargs, reqs=reqs, progress=False)
        result.update(workload=workload, config=label)
        rows.append(result)
        accepted = result.get("spec_mean_accepted_length")
        print(
            f"{workload:9} {label:26} {result['output_throughput']:8.1f} out tok/s"
            + (f"   {accepted:.2f} tokens per verifying step" if accepted else ""),
            flush=True,
        )
        return result

    formats = [("file", {})] + ([("bf16", {"quantization": "none"})] if is_gguf else [])
    summary = {}
    if ns.draft and is_gguf:
        draft = {"method": "draft", "num_speculative_tokens": ns.num_speculative_tokens}
        bf16 = {"quantization": "none", "max_num_seqs": 1}
        chat = make_workload("chat", tokenizer, num_prompts=ns.grounded_prompts)
        for workload, reqs in (("grounded", grounded), ("chat", chat)):
            off = run(workload, reqs, "bf16 B=1", **bf16)
            on = run(workload, reqs, "bf16 B=1 draft (file)", speculative_config=draft, **bf16)
            summary[f"{workload}_b1_bf16_draft_speedup"] = (
                on["output_throughput"] / off["output_throughput"]
            )
            summary[f"{workload}_b1_bf16_draft_identical"] = (
                on["outputs_digest"] == off["outputs_digest"]
            )
        off = run("mixed", mixed, "64 in flight bf16", quantization="none")
        on = run(
            "mixed", mixed, "64 in flight bf16 draft", quantization="none", speculative_config=draft
        )
        summary["mixed_bf16_draft_ratio"] = on["output_throughput"] / off["output_throughput"]
        summary["mixed_bf16_draft_identical"] = on["outputs_digest"] == off["outputs_digest"]
    if ns.skip_ngram:
        formats, ns.batch_sizes = [], ""
    for name, extra in formats:
        off = run("grounded", grounded, f"{name} B=1", max_num_seqs=1, **extra)
        on = run(
            "grounded",
            grounded,
            f"{name} B=1 ngram",
            max_num_seqs=1,
            speculative_config=spec,
            **extra,
        )
        summary[f"grounded_b1_{name}_speedup"] = on["output_throughput"] / off["output_throughput"]
        summary[f"grounded_b1_{name}_identical"] = on["outputs_digest"] == off["outputs_digest"]
    always = {**spec, "disable_by_batch_size": 1 << 20}
    for batch in [int(b) for b in ns.batch_sizes.split(",") if b]:
        reqs = make_workload("grounded", tokenizer, num_prompts=4 * batch)
        off = run("grounded", reqs, f"file B={batch}", max_num_seqs=batch)
        on = run(
            "grounded", reqs, f"file B={batch} ngram", max_num_seqs=batch, speculative_config=always
        )
        summary[f"grounded_b{batch}_file_speedup"] = (
            on["output_throughput"] / off["output_throughput"]
        )
    if not ns.skip_ngram:
        off = run("mixed", mixed, "64 in flight")
        on = run("mixed", mixed, "64 in flight ngram", speculative_config=spec)
        summary["mixed_ratio"] = on["output_throughput"] / off["output_throughput"]
        summary["mixed_identical"] = on["outputs_digest"] == off["outputs_digest"]
    for key, value in summary.items():
        print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    if ns.output_json:
        record = {"machine": machine_info(), "versions": versions(), "summary": summary}
        with open(ns.output_json, "w") as f:
            json.dump({**record, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
