"""Documents reranked per second from the same GGUF file: `pagoda serve` against
llama.cpp's `llama-server --reranking`, one client posting /v1/rerank to each (the
Cohere/Jina shape both serve), and sentence-transformers' CrossEncoder.predict on the
folder the file came from, the scores of each checked against CrossEncoder's.

    python benchmarks/rerank_vs_llamacpp.py --llama-cpp SRC --out DIR \\
        --output-json docs/perf/rerank_vs_llamacpp.json

The model: random weights of bge-reranker-base's shape (XLM-R base: 12 layers, 768
wide, 250,002 embedding rows, one label) with a SentencePiece Unigram vocabulary
trained here (tests/helpers.py; its NFKC map included), made by transformers, then
F16 and Q8_0 files by llama.cpp's own convert_hf_to_gguf.py (SRC: a llama.cpp source
tree, the llama-cpp-python sdist's vendor/llama.cpp; its build's llama-server in
SRC/build/bin). Each request: one query and `--documents` documents, each pair cut to
`--tokens` tokens; `--num-batches` requests one after another, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import httpx
import numpy as np
import torch

sys.path[0] = __file__.rsplit("/benchmarks/", 1)[0]  # the repository (tests.helpers)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

from embeddings import best_rate, texts  # noqa: E402
from embeddings_vs_llamacpp import serving  # noqa: E402

from tests.helpers import make_encoder  # noqa: E402

SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
             max_position_embeddings=514, vocab_size=250002, initializer_range=0.02)  # fmt: skip


def make_files(llama_cpp: str, out: str) -> tuple[str, dict[str, str]]:
    """The folder, and its F16 and Q8_0 files by llama.cpp's converter (made once)."""
    folder = os.path.join(out, "bge-reranker-base-shaped")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        torch.manual_seed(0)
        make_encoder(folder, "xlm-roberta", num_labels=1, **SHAPE)
    env = {**os.environ, "PYTHONPATH": os.path.join(llama_cpp, "gguf-py")}
    files = {}
    for outtype in ("f16", "q8_0"):
        path = files[outtype.upper()] = os.path.join(out, f"bge-reranker-base-shaped-{outtype.upper()}.gguf")  # fmt: skip
        if not os.path.isfile(path):
            subprocess.run(
                [sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), folder,
                 "--outfile", path, "--outtype", outtype],
                env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
    return folder, files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--documents", type=int, default=64)
    ap.add_argument("--num-batches", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-ubatch", type=int, default=512)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from sentence_transformers import CrossEncoder

    from pagoda.bench.report import write_json

    folder, files = make_files(args.llama_cpp, args.out)
    ce = CrossEncoder(folder, device="cpu", max_length=args.tokens)
    tok = ce.tokenizer
    query = tok.decode(tok(texts(1, 7)[0], add_special_tokens=False)["input_ids"][:12])
    # <s> query </s></s> document </s>: each pair exactly `tokens` tokens
    room = args.tokens - len(tok(query)["input_ids"]) - 2
    docs = [tok.decode(tok(t, add_special_tokens=False)["input_ids"][:room])
            for t in texts(args.documents * args.num_batches, 42)]  # fmt: skip
    batches = [docs[i : i + args.documents] for i in range(0, len(docs), args.documents)]
    reference = ce.predict([(query, d) for d in docs])
    results = [{"system": "sentence-transformers", "file": "folder (float32)",
                "documents_per_s": best_rate(lambda: ce.predict([(query, d) for d in docs], batch_size=args.documents), len(docs), args.repeats)}]  # fmt: skip
    print(f"sentence-transformers: {results[0]['documents_per_s']:8.1f} documents/s")
    llama_server = os.path.join(args.llama_cpp, "build", "bin", "llama-server")
    ctx = args.documents * (args.tokens + 16)
    for name, path in files.items():
        servers = {
            "pagoda": [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", path,
                       "--port", "8141", "--max-num-batched-tokens", str(ctx),
                       "--max-num-seqs", str(args.documents), "--disable-uvicorn-access-log"],
            "llama.cpp": [llama_server, "-m", path, "--reranking", "--port", "8142",
                          "-t", str(os.cpu_count()), "-c", str(ctx), "-b", str(args.llama_ubatch),
                          "-ub", str(args.llama_ubatch), "-np", str(args.documents), "--log-disable"],
        }  # fmt: skip
        for system, cmd in servers.items():
            scores: list[float] = []
            with serving(cmd) as url:
                client = httpx.Client(base_url=url, timeout=600)

                def run(client=client, scores=scores):
                    scores.clear()
                    for batch in batches:
                        r = client.post("/v1/rerank", json={"query": query, "documents": batch, "top_n": len(batch)})  # fmt: skip
                        r.raise_for_status()
                        ranked = sorted(r.json()["results"], key=lambda x: x["index"])
                        scores.extend(x["relevance_score"] for x in ranked)

                rate = best_rate(run, len(docs), args.repeats)
            got = np.asarray(scores)
            # llama.cpp's relevance_score is the label's logit; pagoda's (and
            # CrossEncoder's) its sigmoid.
            probs = 1 / (1 + np.exp(-got)) if system == "llama.cpp" else got
            err = float(np.abs(probs - reference).max())
            ranks = np.corrcoef(np.argsort(np.argsort(probs)), np.argsort(np.argsort(reference)))[0, 1]  # fmt: skip
            results.append({"system": system, "file": name, "documents_per_s": rate,
                            "max_abs_error_vs_cross_encoder": err,
                            "rank_correlation_vs_cross_encoder": float(ranks), "command": cmd})  # fmt: skip
            print(f"{system:>10} {name}: {rate:8.1f} documents/s  max |score - CrossEncoder| {err:.2e}  rank correlation {ranks:.4f}")  # fmt: skip
    for r in results:
        peer = next((x for x in results if x["system"] == "llama.cpp" and x["file"] == r["file"]), None)  # fmt: skip
        if peer is not None:
            r["vs_llama_cpp"] = r["documents_per_s"] / peer["documents_per_s"]
        r["vs_sentence_transformers"] = r["documents_per_s"] / results[0]["documents_per_s"]
    if args.output_json:
        config = {"shape": SHAPE, "documents_per_request": args.documents,
                  "tokens_per_pair": args.tokens, "documents": len(docs)}  # fmt: skip
        write_json(args.output_json, config, results)


if __name__ == "__main__":
    main()
