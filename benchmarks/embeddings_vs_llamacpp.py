"""Embeddings per second from the same GGUF file: `pagoda serve` against llama.cpp's
`llama-server --embeddings`, both driven by one client over /v1/embeddings (the
official `openai` package), each checked against sentence-transformers on the folder
the file was converted from.

    LLAMA_SERVER=.../llama-server python benchmarks/embeddings_vs_llamacpp.py \\
        --gguf all-MiniLM-L6-v2-Q8_0.gguf --folder path/to/all-MiniLM-L6-v2 \\
        --output-json docs/perf/embeddings_vs_llamacpp.json

The file: llama.cpp's own `convert_hf_to_gguf.py` on the folder. Inputs of 128 tokens
(random words cut to length by the tokenizer), `--batch-size` inputs a request,
`--num-batches` requests one after another, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from embeddings import best_rate, texts  # noqa: E402


def wait_up(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} did not come up")


@contextlib.contextmanager
def serving(cmd: list[str]):
    """The server `cmd` (its `--port`) started, up, and stopped after: yields its URL."""
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--folder", required=True, help="the sentence-transformers folder it came from")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--num-batches", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    # llama.cpp runs a BERT's ubatch as one attention over all its tokens (a mask keeps
    # the sequences apart), so its cost grows with the ubatch's square: a few inputs a
    # ubatch is its best (on all-MiniLM, 2-core EPYC: 48 embeddings/s at 128-512 tokens
    # a ubatch, 40 at 1,024, 14 with the whole request, 9,216, in one).
    ap.add_argument("--llama-ubatch", type=int, default=256)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    import openai
    from sentence_transformers import SentenceTransformer

    from pagoda.bench.report import machine_info

    st = SentenceTransformer(args.folder, device="cpu")
    st.max_seq_length = args.tokens
    # Texts cut to exactly `tokens` tokens (with [CLS] and [SEP]) by the model's own
    # tokenizer, so both servers see the same inputs whole.
    tok = st.tokenizer
    inputs = [
        tok.decode(tok(t, add_special_tokens=False)["input_ids"][: args.tokens - 2])
        for t in texts(args.batch_size * args.num_batches, 42)
    ]
    reference = st.encode(inputs)
    llama_server = os.environ.get("LLAMA_SERVER", "llama-server")
    ctx = args.batch_size * (args.tokens + 16)
    servers = {
        "pagoda": [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", args.gguf,
                   "--port", "8131", "--max-num-batched-tokens", str(ctx),
                   "--max-num-seqs", str(args.batch_size), "--disable-uvicorn-access-log"],
        "llama.cpp": [llama_server, "-m", args.gguf, "--embeddings", "--port", "8132",
                      "-t", str(os.cpu_count()), "-c", str(ctx), "-b", str(args.llama_ubatch),
                      "-ub", str(args.llama_ubatch),
                      "-np", str(args.batch_size), "--log-disable"],
    }  # fmt: skip
    results = []
    for system, cmd in servers.items():
        with serving(cmd) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            got: list[list[float]] = []
            model = client.models.list().data[0].id

            def run(client=client, got=got, model=model):
                got.clear()
                for i in range(0, len(inputs), args.batch_size):
                    r = client.embeddings.create(model=model, input=inputs[i : i + args.batch_size])
                    got.extend(d.embedding for d in r.data)

            rate = best_rate(run, len(inputs), args.repeats)
        vectors = np.asarray(got)
        cos = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)  # fmt: skip
        results.append({"system": system, "embeddings_per_s": rate,
                        "min_cosine_vs_sentence_transformers": float(cos.min()), "command": cmd})  # fmt: skip
        print(
            f"{system:>10}: {rate:8.1f} embeddings/s  min cosine vs sentence-transformers {cos.min():.6f}"
        )
    base = results[1]["embeddings_per_s"]
    for r in results:
        r["vs_llama_cpp"] = r["embeddings_per_s"] / base
    report = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(),
        "python": platform.python_version(),
        "gguf": os.path.basename(args.gguf),
        "batch_size": args.batch_size,
        "tokens_per_input": args.tokens,
        "inputs": len(inputs),
        "results": results,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
