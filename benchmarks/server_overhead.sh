#!/usr/bin/env bash
# What the server adds per token at batch 1: the same requests (4 `uniform`, one at a
# time) through `LLM`'s engine in-process (`pagoda bench throughput`) and through
# `pagoda serve` over HTTP with streaming (`pagoda bench serve`), same flags.
#
#   benchmarks/server_overhead.sh [OUT_DIR] [-- extra engine flags, e.g. --quantization none]
set -euo pipefail

out=${1:-bench_results/server_overhead}
shift || true
[[ ${1:-} == "--" ]] && shift
port=8094
mkdir -p "$out"

pagoda bench throughput --workload uniform --num-prompts 4 --max-num-seqs 1 --no-progress \
  --output-json "$out/offline.json" "$@"

pagoda serve --port "$port" --max-num-seqs 1 --disable-uvicorn-access-log "$@" >"$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 1
done
gguf=$(python3 -c 'from pagoda.model_executor.default_model import default_model_path; print(default_model_path())')
pagoda bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$gguf" --workload uniform \
  --num-prompts 4 --max-concurrency 1 --label "pagoda serve B=1" --no-progress \
  --output-json "$out/server.json"

python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
offline = json.load(open(f"{out}/offline.json"))
server = json.load(open(f"{out}/server.json"))
a, b = offline["results"][0]["tpot_ms"]["mean"], server["results"][0]["tpot_ms"]["mean"]
print(f"batch-1 TPOT: LLM engine {a:.2f} ms, pagoda serve {b:.2f} ms, server/offline {b / a:.3f}")
EOF
