"""llama.cpp's own converter against pagoda's GGUF loader, family by family.

For each family: a tiny random model from transformers' config (the test suite's,
with the default model's SmolLM2 vocabulary, whose pre-tokenizer the converter
knows), converted by llama.cpp's convert_hf_to_gguf.py to F32; pagoda loads the file
and its greedy tokens (float32) are compared with transformers' on the HF folder.
The tests check the same layouts with files written by the `gguf` package
(tests/gguf_writer.py); this checks them against the converter itself.

    python benchmarks/llamacpp_converter_check.py --llama-cpp /path/to/llama.cpp \
        [--families qwen3 gemma3 ...] [--output-json docs/perf/llamacpp_converter_check.json]

`--llama-cpp`: a llama.cpp source tree (the llama-cpp-python sdist's vendor/llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

# The repository, not this folder: its kernels.py would shadow the `kernels` package
# that transformers looks for.
sys.path[0] = __file__.rsplit("/benchmarks/", 1)[0]

from pagoda import LLM  # noqa: E402
from pagoda.bench.report import machine_info  # noqa: E402
from pagoda.model_executor.model_files import load_tokenizer  # noqa: E402
from tests.helpers import GGUF_OVERRIDES, make_model, smollm2_gguf, tiny_prompts  # noqa: E402
from tests.helpers import family_greedy as greedy  # noqa: E402
from tests.helpers import family_hf_greedy as hf_greedy  # noqa: E402

FAMILIES = [
    "llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "granite", "smollm3",
    "deepseek_v2", "deepseek_v3",
]  # fmt: skip


def tiny_folder(root: str, arch: str, tokenizer_dir: str) -> str:
    """The tests' tiny model of `arch` with the SmolLM2 tokenizer's 49152-token vocabulary."""
    folder = make_model(
        os.path.join(root, arch), arch, vocab_size=49152, **GGUF_OVERRIDES.get(arch, {})
    )
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    config = os.path.join(folder, "tokenizer_config.json")
    with open(config) as f:
        tok = json.load(f)
    tok["tokenizer_class"] = "GPT2Tokenizer"  # what Phi-4's says (the converter reads it)
    with open(config, "w") as f:
        json.dump(tok, f)
    return folder


def check(arch: str, root: str, tokenizer_dir: str, llama_cpp: str) -> dict:
    folder = tiny_folder(root, arch, tokenizer_dir)
    path = os.path.join(root, f"{arch}.gguf")
    done = subprocess.run(
        [sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), folder,
         "--outfile", path, "--outtype", "f32"],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        return {"family": arch, "converted": False, "error": done.stderr.strip().splitlines()[-1]}
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 26)
    long = arch == "phi3"  # past the original context: HF's long factors, as ours
    prompts = tiny_prompts(load_tokenizer(path, True), n=8, seed=21)
    if long:
        prompts = [(p * 100)[: 70 + 5 * i] for i, p in enumerate(prompts)]
    expected = hf_greedy(folder, tuple(map(tuple, prompts)), 16)
    got = greedy(llm, prompts, 16)
    equal = sum(a == b for a, b in zip(got, expected, strict=True))
    return {
        "family": arch,
        "converted": True,
        "architecture": llm.llm_engine.model_config.architecture,
        "prompts_token_exact": equal,
        "prompts": len(prompts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree")
    parser.add_argument("--families", nargs="*", default=FAMILIES)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        tokenizer_dir = os.path.join(root, "tokenizer")
        load_tokenizer(smollm2_gguf(), True).save_pretrained(tokenizer_dir)
        results = []
        for arch in args.families:
            result = check(arch, root, tokenizer_dir, args.llama_cpp)
            results.append(result)
            print(json.dumps(result), flush=True)
    report = {"command": " ".join(sys.argv), "machine": machine_info(), "results": results}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
