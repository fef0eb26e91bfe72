#!/usr/bin/env bash
# Prefill and decode speed per GGUF file, pagoda against llama.cpp's llama-bench, both
# in-process (no HTTP), on the same file and THREADS (default 2):
#
#   LLAMA_BENCH=/path/to/llama-bench benchmarks/formats_vs_llamacpp.sh FILE.gguf [...]
#
# llama.cpp: pp512 (a 512-token prompt) and tg128 (128 tokens from an empty context).
# pagoda: `pagoda bench latency` at batch 1 with a 512-token prompt (prefill rate) and
# with an 8-token prompt and 128 new tokens (decode rate), bf16 activations, the
# file's blocks as they load by default. Without files, the default model's.
set -euo pipefail

: "${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary}"
threads=${THREADS:-2}
out=${OUT_DIR:-bench_results/formats_vs_llamacpp}
mkdir -p "$out"
files=("$@")
if [[ ${#files[@]} -eq 0 ]]; then
  files=("$(python3 -c 'from pagoda.model_executor.default_model import default_model_path; print(default_model_path())')")
fi

for file in "${files[@]}"; do
  name=$(basename "$file" .gguf)
  echo "== $name" >&2
  "$LLAMA_BENCH" -m "$file" -t "$threads" -p 512 -n 128 -r 3 -o json >"$out/$name.llama.json" 2>/dev/null
  pagoda bench latency --model "$file" --dtype bfloat16 --num-threads "$threads" --batch-sizes 1 \
    --input-len 512 --output-len 1 --output-json "$out/$name.prefill.json" >/dev/null 2>&1
  pagoda bench latency --model "$file" --dtype bfloat16 --num-threads "$threads" --batch-sizes 1 \
    --input-len 8 --output-len 128 --output-json "$out/$name.decode.json" >/dev/null 2>&1
done

python3 - "$out" "${files[@]}" <<'PY'
import collections, json, os, sys

import gguf

out, files = sys.argv[1], sys.argv[2:]
print(f"{'file':<28} {'tensor types':<34} {'pp512 pagoda':>12} {'llama.cpp':>10} {'x':>5}"
      f" {'tg pagoda':>10} {'llama.cpp':>10} {'x':>5}")
for file in files:
    name = os.path.basename(file).removesuffix(".gguf")
    types = collections.Counter(
        t.tensor_type.name for t in gguf.GGUFReader(file).tensors if t.tensor_type.name != "F32"
    )
    mix = " ".join(f"{k}:{v}" for k, v in types.most_common(3))
    llama = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"]
             for r in json.load(open(f"{out}/{name}.llama.json"))}
    pre = json.load(open(f"{out}/{name}.prefill.json"))["results"][0]["prefill_tok_s"]
    dec = json.load(open(f"{out}/{name}.decode.json"))["results"][0]["decode_tok_s"]
    print(f"{name:<28} {mix:<34} {pre:>12.1f} {llama['pp']:>10.1f} {pre / llama['pp']:>5.2f}"
          f" {dec:>10.1f} {llama['tg']:>10.1f} {dec / llama['tg']:>5.2f}")
PY
