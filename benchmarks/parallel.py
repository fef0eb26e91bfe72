"""What tensor and pipeline parallel cost on one machine, one command:

    python benchmarks/parallel.py [--model M] [--batch 16] [--output-len 64] [--output-json F]

Offline, `batch` requests of a 64-token prompt and `output-len` tokens each
(ignore_eos), greedy, in the model's default dtype:

- TP=1 on all cores (the C++ decode loop: the default engine);
- TP=1 on all cores with --enforce-eager (the Python model, as the split runs it);
- TP=2, PP=2: two workers, one core each (gloo between them); PP=2 also with one
  step in flight instead of two, to show what keeping both stages busy buys.

Reported: output tok/s and ms per decode step for each, and the all-reduce itself
(two gloo processes, one core each, a [batch, hidden] tensor in the model's dtype),
times the all-reduces of one step (two per layer, one for the embedding) and the
pipeline's sends. Figures are ratios within this one command; name the CPU with them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def run_engine(
    model: str, batch: int, output_len: int, steps_in_flight: int | None = None, **kwargs
) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(model, **kwargs)
    if steps_in_flight is not None:  # the engine keeps pp steps in flight; fewer to compare
        llm.llm_engine._pipeline_depth = steps_in_flight
    try:
        prompts = [
            {"prompt_token_ids": [1000 + 7 * i + j for j in range(64)]} for i in range(batch)
        ]
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        hidden = llm.llm_engine.model_config.hf_config["hidden_size"]
        layers = llm.llm_engine.model_config.hf_config["num_hidden_layers"]
        dtype = llm.llm_engine.model_config.dtype
    finally:
        llm.llm_engine.shutdown()
    return {
        "output_tok_s": batch * output_len / wall,
        "ms_per_step": wall / output_len * 1e3,  # one prefill step, then decodes
        "hidden": hidden,
        "layers": layers,
        "dtype": dtype,
    }


def _all_reduce_worker(rank: int, store: str, rows: int, hidden: int, dtype: str, out) -> None:
    import torch
    import torch.distributed as dist

    from pagoda.distributed import ParallelContext

    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    context = ParallelContext.init(2, 1, rank, os.path.dirname(store))
    x = torch.randn(rows, hidden).to(getattr(torch, dtype))
    n = 2000

    def timed(fn) -> float:
        for _ in range(50):
            fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    gloo = timed(lambda: dist.all_reduce(x))
    shm = timed(lambda: context.all_reduce(x))  # what the engine runs
    send = torch.empty_like(x)
    sent = timed(lambda: dist.send(send, 1) if rank == 0 else dist.recv(send, 0))
    if rank == 0:
        out.put((gloo, shm, sent))
    dist.destroy_process_group()


def time_collectives(rows: int, hidden: int, dtype: str) -> tuple[float, float, float]:
    """Seconds per all-reduce of a [rows, hidden] tensor, two processes (gloo, and the
    engine's shared-memory path) and per send from one stage to the next."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_all_reduce_worker, args=(r, store, rows, hidden, dtype, out))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        result = out.get(timeout=300)
        for p in procs:
            p.join()
    return result


def main() -> None:
    from pagoda.bench.report import machine_info, versions
    from pagoda.model_executor.model_files import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    model = args.model or resolve_model(None)[0]
    cores = len(os.sched_getaffinity(0))
    runs = {
        f"TP=1 ({cores} cores)": dict(num_threads=cores),
        f"TP=1 eager ({cores} cores)": dict(num_threads=cores, enforce_eager=True),
        "TP=2 (1 core each)": dict(tensor_parallel_size=2),
        "PP=2 (1 core each)": dict(pipeline_parallel_size=2),
        "PP=2, 1 step in flight": dict(pipeline_parallel_size=2, steps_in_flight=1),
    }
    results = {}
    for name, kwargs in runs.items():
        results[name] = run_engine(model, args.batch, args.output_len, **kwargs)
        print(f"{name:28s} {results[name]['output_tok_s']:8.1f} tok/s "
              f"{results[name]['ms_per_step']:7.2f} ms/step", flush=True)  # fmt: skip
    first = next(iter(results.values()))
    gloo_s, shm_s, send_s = time_collectives(args.batch, first["hidden"], first["dtype"])
    per_step = 2 * first["layers"] + 1
    print(
        f"all-reduce of [{args.batch}, {first['hidden']}] {first['dtype']}: gloo "
        f"{gloo_s * 1e6:.1f} us, shared memory {shm_s * 1e6:.1f} us; x{per_step} per decode "
        f"step = {gloo_s * per_step * 1e3:.2f} / {shm_s * per_step * 1e3:.2f} ms; "
        f"a stage's send: {send_s * 1e6:.1f} us"
    )
    report = {
        "model": model,
        "machine": machine_info(),
        "versions": versions(),
        "batch": args.batch,
        "output_len": args.output_len,
        "runs": results,
        "all_reduce_gloo_us": gloo_s * 1e6,
        "all_reduce_shm_us": shm_s * 1e6,
        "all_reduces_per_step": per_step,
        "send_us": send_s * 1e6,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
