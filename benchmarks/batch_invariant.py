"""What the batch-invariant mode costs (issue 40), in one command.

The default model (SmolLM2-135M-Instruct's q4_1 GGUF, kept in its blocks) and the same
file expanded to bf16, each with and without `batch_invariant`: output tokens/s on the
`mixed` workload (64 requests, prompts 32-512, outputs 32-256, all at t=0) and at batch
1 (3 requests of 128 + 128 tokens, one at a time). Each run in a fresh process; the two
modes alternate over the rounds, and the medians are compared.

    python benchmarks/batch_invariant.py --output-json docs/perf/batch_invariant.json
    python benchmarks/batch_invariant.py --workloads batch1 --rounds 6 \
        --output-json docs/perf/batch_invariant.json   # (updates those entries)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch

from pagoda.bench.report import cpu_name
from pagoda.bench.throughput import in_subprocess
from pagoda.bench.workloads import make_workload
from pagoda.model_executor.default_model import default_model_path
from pagoda.model_executor.model_files import load_tokenizer

WORKLOADS = {  # name -> (workload, number of prompts, engine settings)
    "mixed": ("mixed", None, {}),
    "batch1": ("uniform", 3, {"max_num_seqs": 1}),  # short and noisy: run more --rounds
}
FORMATS = {"q4_1": {}, "bf16": {"quantization": "none", "dtype": "bfloat16"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    path = default_model_path()
    tokenizer = load_tokenizer(path, True)
    results: dict = {}
    for fmt in args.formats.split(","):
        for name in args.workloads.split(","):
            workload, num_prompts, settings = WORKLOADS[name]
            reqs = make_workload(workload, tokenizer, num_prompts=num_prompts)
            runs: dict[str, list[dict]] = {"off": [], "on": []}
            for r in range(args.rounds):
                for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    kwargs = dict(
                        model=path, batch_invariant=mode == "on", **FORMATS[fmt], **settings
                    )
                    out = in_subprocess(
                        "run_pagoda", engine_kwargs=kwargs, reqs=reqs, progress=False
                    )
                    out.pop("per_request", None)
                    runs[mode].append(out)
                    print(f"{fmt} {name} {mode}: {out['output_throughput']:.1f} tok/s, "
                          f"TPOT {out['tpot_ms']['mean']:.1f} ms")  # fmt: skip
            median = {m: statistics.median(o["output_throughput"] for o in runs[m]) for m in runs}
            results[f"{fmt}/{name}"] = {
                "output_tok_s_off": median["off"],
                "output_tok_s_on": median["on"],
                "on_over_off": median["on"] / median["off"],
                "tpot_ms_off": statistics.median(o["tpot_ms"]["mean"] for o in runs["off"]),
                "tpot_ms_on": statistics.median(o["tpot_ms"]["mean"] for o in runs["on"]),
                "runs": runs,
            }
            print(f"{fmt} {name}: on/off {median['on'] / median['off']:.3f}")
    report = {
        "commands": [" ".join(["python", *sys.argv])],
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "results": results,
    }
    if args.output_json:
        if os.path.exists(args.output_json):  # a run of some formats or workloads updates them
            with open(args.output_json) as f:
                earlier = json.load(f)
            report["results"] = {**earlier["results"], **results}
            report["commands"] = earlier.get("commands", []) + report["commands"]
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
