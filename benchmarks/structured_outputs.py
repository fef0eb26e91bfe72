"""What structured outputs cost: `mixed` (64 requests in flight) with a JSON schema on
every request vs none, and the grammar compile time per schema. One command:

    python benchmarks/structured_outputs.py [--model M] [--output-json docs/perf/structured_outputs.json]

Each request under a schema stops when its JSON is complete, so the two runs do not
have the same batch sizes step by step; the comparison is the time of a pure decode
step at the same number of running requests (buckets of 16), in both runs. Within the
schema run, the time spent filling the batch's bitmask (llguidance, both cores) and
applying it to the logits is measured on its own. The schemas are
`pagoda.bench.workloads.json_schemas(50)`, one per request in turn, so 50 distinct
grammars compile (the first also builds llguidance's view of the tokenizer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from pagoda import EngineArgs, LLMEngine, SamplingParams, StructuredOutputsParams
from pagoda.bench.report import machine_info, versions
from pagoda.bench.workloads import json_schemas, make_workload
from pagoda.model_executor.model_files import load_tokenizer, resolve_model
from pagoda.sample import sampler

APPLY_BITMASK = sampler.apply_bitmask


class Timer:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def run(model: str, reqs, schemas: list[dict] | None) -> dict:
    engine = LLMEngine(EngineArgs(model=model, max_num_seqs=64))
    fill = Timer(engine.grammar_compiler.bitmask)
    engine.grammar_compiler.bitmask = fill
    apply = Timer(APPLY_BITMASK)
    sampler.apply_bitmask = apply
    for i, r in enumerate(reqs):
        so = StructuredOutputsParams(json=schemas[i % len(schemas)]) if schemas else None
        params = SamplingParams(
            temperature=0.0, max_tokens=r.output_len, ignore_eos=True, structured_outputs=so
        )
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params)
    by_bucket: dict[int, list[float]] = defaultdict(list)
    grammar_by_bucket: dict[int, list[float]] = defaultdict(list)
    num_tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decode_only = (
            running
            and not engine.scheduler.waiting
            and not engine.scheduler.waiting_for_grammar
            and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)
        )
        rows, before = len(running), fill.seconds + apply.seconds
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        num_tokens += sum(1 for o in outputs)
        if decode_only:
            bucket = min(64, (rows + 15) // 16 * 16)
            by_bucket[bucket].append(elapsed)
            grammar_by_bucket[bucket].append(fill.seconds + apply.seconds - before)
    duration = time.perf_counter() - start
    result = {
        "schema": schemas is not None,
        "duration_s": duration,
        "step_ms_by_running": {
            b: 1e3 * statistics.mean(v) for b, v in sorted(by_bucket.items()) if len(v) >= 3
        },
        "steps_by_running": {b: len(v) for b, v in sorted(by_bucket.items())},
        "grammar_ms_by_running": {
            b: 1e3 * statistics.mean(v) for b, v in sorted(grammar_by_bucket.items()) if len(v) >= 3
        },
        "mask_fill_s": fill.seconds,
        "mask_apply_s": apply.seconds,
    }
    if schemas:
        compile_s = engine.grammar_compiler.compile_seconds
        result.update(
            grammars_compiled=len(compile_s),
            grammar_tokenizer_s=engine.grammar_compiler.tokenizer_seconds,
            compile_ms_median=1e3 * statistics.median(compile_s),
            compile_ms_max=1e3 * max(compile_s),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    path, is_gguf = resolve_model(ns.model)
    reqs = make_workload("mixed", load_tokenizer(path, is_gguf))
    plain = run(path, reqs, None)
    constrained = run(path, reqs, json_schemas(50))
    overhead = {
        b: constrained["step_ms_by_running"][b] / ms - 1
        for b, ms in plain["step_ms_by_running"].items()
        if b in constrained["step_ms_by_running"]
    }
    report = {
        "machine": machine_info(),
        "versions": versions(),
        "model": path,
        "no_schema": plain,
        "json_schema": constrained,
        "step_overhead_by_running": overhead,
    }
    print(json.dumps(report, indent=2))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
