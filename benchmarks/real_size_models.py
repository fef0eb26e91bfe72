"""Random-weight models of real configs, as GGUF files made by llama.cpp's own tools.

For each family: transformers builds the model from the released config (random bf16
weights: only speed is measured), saved as a Hugging Face folder with the default
model's SmolLM2 tokenizer (a pre-tokenizer llama.cpp's converter knows; its vocabulary
padded with unreachable entries to the config's size, so the embedding and the
lm_head keep their real shapes); llama.cpp's convert_hf_to_gguf.py writes a BF16 file
and llama-quantize the Q4_0 and Q8_0 ones.

    python benchmarks/real_size_models.py --llama-cpp SRC --llama-bin BIN --out DIR \\
        [--families qwen3-1.7b gemma-3-1b phi-4-mini] [--types Q4_0 Q8_0]

SRC: a llama.cpp source tree (the llama-cpp-python sdist's vendor/llama.cpp); BIN:
its build's bin folder (llama-quantize). Prints each file's path. The converter's
Qwen path imports `sentencepiece` (pip install sentencepiece) even for a BPE vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

# The released configs' shapes (Hugging Face config.json, the fields that matter).
CONFIGS = {
    "qwen3-1.7b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_act="silu", attention_bias=False,
    ),
    "gemma-3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, sliding_window=512, sliding_window_pattern=6,
        query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None, tie_word_embeddings=True,
    ),
    "phi-4-mini": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=200064, rope_theta=10000.0,
        partial_rotary_factor=0.75, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=262144,
        tie_word_embeddings=True, hidden_act="silu",
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                      "long_factor": [1.0 + i for i in range(48)]},
    ),
}  # fmt: skip


def make_folder(name: str, folder: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagoda.model_executor.default_model import default_model_path
    from pagoda.model_executor.model_files import load_tokenizer

    cfg = dict(CONFIGS[name])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # HF's init leaves some weights at exactly zero or one
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    del model
    tokenizer = load_tokenizer(default_model_path(), True)
    tokenizer.save_pretrained(folder)
    path = os.path.join(folder, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    used = len(vocab) + len(tok["added_tokens"])
    for i in range(used, config.vocab_size):  # unreachable: no merge makes them
        vocab[f"<unused{i}>"] = i
    with open(path, "w") as f:
        json.dump(tok, f)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        tok_config = json.load(f)
    tok_config["tokenizer_class"] = "GPT2Tokenizer"  # Phi-4's says so; the converter reads it
    with open(path, "w") as f:
        json.dump(tok_config, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True)
    parser.add_argument("--llama-bin", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", nargs="*", default=list(CONFIGS))
    parser.add_argument("--types", nargs="*", default=["Q4_0", "Q8_0"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.families:
        folder = os.path.join(args.out, name)
        bf16 = os.path.join(args.out, f"{name}-BF16.gguf")
        if not os.path.isfile(bf16):
            make_folder(name, folder)
            subprocess.run(
                [sys.executable, os.path.join(args.llama_cpp, "convert_hf_to_gguf.py"), folder,
                 "--outfile", bf16, "--outtype", "bf16"],
                check=True,
            )  # fmt: skip
        for qtype in args.types:
            out = os.path.join(args.out, f"{name}-{qtype}.gguf")
            if not os.path.isfile(out):
                subprocess.run(
                    [os.path.join(args.llama_bin, "llama-quantize"), bf16, out, qtype],
                    check=True, capture_output=True,
                )  # fmt: skip
            print(out, flush=True)


if __name__ == "__main__":
    main()
