"""Where a decode step's time goes: cProfile over decode steps at one batch size (after
every prompt is in), grouped into the model's linear layers, its attention layers,
the rest of the forward, sampling and the engine around it. Writes JSON.

    python benchmarks/step_profile.py --batch-size 64 --steps 20 --output-json docs/perf/step_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import random
import sys
import time

import torch

from pagoda import EngineArgs, LLMEngine, SamplingParams
from pagoda.bench.report import machine_info

# (group, file suffix, function name): cumulative time of that function
GROUPS = [
    ("step", "engine/llm_engine.py", "step"),
    ("forward", "worker/model_runner.py", "forward_step"),
    ("sample", "worker/model_runner.py", "sample_step"),
    ("linear", "layers/linear.py", "forward"),
    ("attention", "layers/attention.py", "forward"),
    ("schedule", "core/scheduler.py", "schedule"),
    ("update", "core/scheduler.py", "update_from_output"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=args.batch_size))
    special = set(engine.tokenizer.all_special_ids)
    vocab = [i for i in range(len(engine.tokenizer)) if i not in special]
    rng = random.Random(42)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch_size):
        prompt = [rng.choice(vocab) for _ in range(args.input_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < args.batch_size:  # the prompts
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(3):  # warm up decode
        engine.step()
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profile).stats
    ms = {}
    for group, suffix, name in GROUPS:
        total = sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(suffix) and fn == name)
        ms[group] = 1000 * total / args.steps
    ms["forward_other"] = ms["forward"] - ms["linear"] - ms["attention"]
    ms["engine_other"] = ms["step"] - ms["forward"] - ms["sample"]
    result = {
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "machine": machine_info(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": args.model or "SmolLM2-135M-Instruct (the default GGUF)",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "steps": args.steps,
        "profiled_wall_ms_per_step": 1000 * wall / args.steps,
        "ms_per_step": ms,
        "note": "cumulative cProfile times (the profiler's own cost included); the shares "
        "are what to read",
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
