"""Decode steps of many rows in the C++ decode loop against the Python layers, in one
process on the default model (SmolLM2 Q4_1): rounds alternate the two, and each pair
of adjacent runs gives a ratio, so the machine's drift cancels. A step's time is
(the run of `--output-len` tokens - the run of one) / (output-len - 1), in wall and
in process CPU seconds (both from the same runs).

    python benchmarks/decode_loop_rows.py [--rows 32,64] [--output-json docs/perf/decode_loop_rows.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from pagoda import LLM, SamplingParams
from pagoda.bench.report import machine_info
from pagoda.model_executor.default_model import default_model_path
from pagoda.ops import cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    llm = LLM(default_model_path(), max_num_seqs=max(rows), enable_prefix_caching=False)
    model = llm.llm_engine.model_runner.model.model  # (its decode_loop_max_rows)

    def step_ms(prompts) -> dict[str, float]:
        def run(max_tokens: int) -> tuple[float, float]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            wall, cpu_s = time.perf_counter(), time.process_time()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - wall, time.process_time() - cpu_s

        full, first = run(args.output_len), run(1)
        scale = 1000 / (args.output_len - 1)
        return {"wall": (full[0] - first[0]) * scale, "cpu": (full[1] - first[1]) * scale}

    results = []
    for n in rows:
        rng = random.Random(n)
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)]}
            for _ in range(n)
        ]
        runs = {"loop": [], "python": []}
        for i in range(args.rounds):
            for mode in ("loop", "python") if i % 2 == 0 else ("python", "loop"):
                model.decode_loop_max_rows = cpu.DECODE_LOOP_MAX_ROWS if mode == "loop" else 0
                runs[mode].append(step_ms(prompts))
        for clock_name in ("wall", "cpu"):
            times = {mode: [r[clock_name] for r in rs] for mode, rs in runs.items()}
            ratios = sorted(p / lp for p, lp in zip(times["python"], times["loop"], strict=True))
            row = {
                "rows": n,
                "clock": clock_name,
                "step_ms": times,
                "python_over_loop_pairs": ratios,
                "median_python_over_loop": ratios[len(ratios) // 2],
            }
            results.append(row)
            print(f"{n} rows, {clock_name}: python/loop per pair {[round(r, 2) for r in ratios]}")
    report = {"command": " ".join(sys.argv), "machine": machine_info(), "results": results}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
