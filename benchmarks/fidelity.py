"""bf16 fidelity of the default model: every greedy token pagoda gives for the eight
test questions (32 tokens each) against transformers' own greedy choice on the same
prefix, transformers in bf16 on the same GGUF file dequantized (decoding step by step
with its KV cache). Two paths of pagoda's:

- `dequantized`: the file's blocks expanded to bf16 (`quantization="none"`): the same
  weights as transformers', so only bf16 arithmetic differs;
- `blocks`: the default, the q4_1 blocks kept with int8 activations.

    python benchmarks/fidelity.py [--output-json docs/perf/bf16_fidelity.json]
"""

from __future__ import annotations

import argparse
import json
import sys

# The repository, not this folder (whose kernels.py would shadow a package).
sys.path[0] = __file__.rsplit("/benchmarks/", 1)[0]

import torch  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.bench.report import machine_info  # noqa: E402
from pagoda.eval.hf_agreement import QUESTIONS, agreement_with_hf_steps, load_hf  # noqa: E402
from pagoda.model_executor.default_model import default_model_path  # noqa: E402

PATHS = {"dequantized": {"quantization": "none"}, "blocks": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-json")
    args = parser.parse_args()

    gguf_path = default_model_path()
    hf = load_hf(gguf_path, torch.bfloat16)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    result = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(),
              "model": gguf_path, "paths": {}}  # fmt: skip
    for name, kwargs in PATHS.items():
        llm = LLM(gguf_path, dtype="bfloat16", kv_cache_memory_bytes=1 << 28, **kwargs)
        outs = llm.chat(convs, params, use_tqdm=False)
        agree, total = agreement_with_hf_steps(hf, outs)
        result["paths"][name] = {"agree": agree, "total": total, "share": agree / total}
        print(f"{name}: {agree} of {total} agree ({100 * agree / total:.1f}%)", flush=True)
        del llm
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
