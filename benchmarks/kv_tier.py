"""The disk KV tier (--kv-offload-dir), in one command:

1. Restart. A 3,000-token prompt (prose from pagoda.eval's held-out text) answered cold
   in a fresh process on an empty tier directory, then again in that process (an
   in-memory prefix-cache hit); the process ends. A new process on the same directory
   answers it again: from the page cache, and once more after the tier's files are
   dropped from the page cache (posix_fadvise), as after a reboot. TTFT of each, and
   the greedy tokens of each (32).
2. Decode while the tier writes. 16 requests of 256 prompt tokens and 32..256 output
   tokens, so that requests finish, and are written, while the others decode: output
   tokens/s and mean inter-token latency with the tier and without, in rounds (which
   goes first alternates), each in a fresh process (and a fresh directory, so every
   block is written); medians over the rounds.

    python benchmarks/kv_tier.py --output-json docs/perf/kv_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from pagoda.bench.report import cpu_name

PROMPT_TOKENS = 3000
GREEDY_TOKENS = 32


def prose_tokens(tokenizer, n: int) -> list[int]:
    from importlib.resources import files

    text = files("pagoda.eval").joinpath("heldout.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def ttft(out) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


def drop_page_cache(folder: str) -> None:
    """Ask the kernel to forget the tier files' cached pages (no root needed)."""
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child_restart(args) -> dict:
    """One process of part 1: `cold` (then a memory hit) or `warm`."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model=args.model, kv_offload_dir=args.dir, max_model_len=4096)
    prompt = prose_tokens(llm.get_tokenizer(), PROMPT_TOKENS)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)

    def answer() -> dict:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return {
            "ttft_s": ttft(out),
            "cached_tokens": out.num_cached_tokens,
            "tokens": list(out.outputs[0].token_ids),
        }

    result = {"first": answer()}
    if args.phase == "cold":
        result["memory_hit"] = answer()
    tier = llm.llm_engine.get_stats().kv_cache.tier
    result["tier"] = vars(tier)
    llm.llm_engine.shutdown()  # writes what is queued
    return result


def child_decode(args) -> dict:
    """One round of part 2, with the tier (args.dir) or without."""
    import random

    from pagoda import LLM, SamplingParams

    kwargs = {"kv_offload_dir": args.dir} if args.dir else {}
    llm = LLM(model=args.model, **kwargs)
    rng = random.Random(0)
    vocab = 40000
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(256)]} for _ in range(16)]  # fmt: skip
    params = [
        SamplingParams(max_tokens=32 + 224 * i // 15, temperature=0.0, ignore_eos=True)
        for i in range(16)
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    itl = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
    ]
    tier = llm.llm_engine.get_stats().kv_cache.tier
    llm.llm_engine.shutdown()
    return {
        "output_tokens_per_s": tokens / seconds,
        "mean_itl_ms": 1000 * statistics.mean(itl),
        "tier_bytes_written": tier.bytes_written if tier else 0,
    }


def run_child(args, **extra) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model]
    for key, value in extra.items():
        cmd += [f"--{key}", str(value)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: pagoda's default model")
    p.add_argument("--rounds", type=int, default=6, help="decode rounds with and without")
    p.add_argument("--output-json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        from pagoda.model_executor.default_model import default_model_path

        args.model = default_model_path()
    if args.child:
        result = child_restart(args) if args.phase in ("cold", "warm") else child_decode(args)
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as folder:
        cold = run_child(args, phase="cold", dir=folder)
        warm = run_child(args, phase="warm", dir=folder)
        drop_page_cache(folder)
        from_disk = run_child(args, phase="warm", dir=folder)
    cold_ttft = cold["first"]["ttft_s"]
    restart = {
        "prompt_tokens": PROMPT_TOKENS,
        "cold_ttft_s": cold_ttft,
        "memory_hit_ttft_s": cold["memory_hit"]["ttft_s"],
        "restart_ttft_s": warm["first"]["ttft_s"],
        "restart_from_disk_ttft_s": from_disk["first"]["ttft_s"],
        "restart_vs_cold": warm["first"]["ttft_s"] / cold_ttft,
        "restart_from_disk_vs_cold": from_disk["first"]["ttft_s"] / cold_ttft,
        "restart_cached_tokens": warm["first"]["cached_tokens"],
        "tier_bytes_read": warm["tier"]["bytes_read"],
        "tier_load_s": warm["tier"]["load_seconds"],
        "tokens_restart_equal_memory_hit": warm["first"]["tokens"] == cold["memory_hit"]["tokens"],
        "tokens_restart_from_disk_equal_memory_hit": from_disk["first"]["tokens"]
        == cold["memory_hit"]["tokens"],
        "tokens_restart_equal_cold": warm["first"]["tokens"] == cold["first"]["tokens"],
        "tokens": {
            "cold": cold["first"]["tokens"],
            "memory_hit": cold["memory_hit"]["tokens"],
            "restart": warm["first"]["tokens"],
        },
    }
    print(json.dumps({k: v for k, v in restart.items() if k != "tokens"}, indent=1))

    rounds = {"without": [], "with": []}
    for i in range(args.rounds):  # alternating which goes first, against drift
        for which in ("without", "with") if i % 2 == 0 else ("with", "without"):
            with tempfile.TemporaryDirectory() as folder:
                extra = {"dir": folder} if which == "with" else {}
                rounds[which].append(run_child(args, phase="decode", **extra))
        print(rounds["without"][-1], rounds["with"][-1], flush=True)

    def median(key: str, which: str) -> float:
        return statistics.median(r[key] for r in rounds[which])

    decode = {
        "rounds": rounds,
        "median_tokens_per_s_without": median("output_tokens_per_s", "without"),
        "median_tokens_per_s_with": median("output_tokens_per_s", "with"),
        "median_itl_ms_without": median("mean_itl_ms", "without"),
        "median_itl_ms_with": median("mean_itl_ms", "with"),
    }
    decode["itl_with_vs_without"] = decode["median_itl_ms_with"] / decode["median_itl_ms_without"]
    print(json.dumps({k: v for k, v in decode.items() if k != "rounds"}, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "command": "python benchmarks/kv_tier.py " + " ".join(sys.argv[1:]),
                    "machine": platform.processor() or platform.machine(),
                    "cpu": cpu_name(),
                    "model": args.model,
                    "restart": restart,
                    "decode_while_writing": decode,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
