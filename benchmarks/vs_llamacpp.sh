#!/usr/bin/env bash
# pagoda against llama.cpp's server: the same client (`pagoda bench serve`), the
# same seeded workload and the same GGUF, one server at a time on this machine,
# one table at the end.
#
#   LLAMA_SERVER=/path/to/llama-server benchmarks/vs_llamacpp.sh [OUT_DIR]
#
# Passes: `mixed` (64 requests at once; llama.cpp with 64 parallel slots) and
# batch 1 (4 `uniform` requests, one in flight: TPOT). Both run the GGUF as it is
# (the default model's is Q4_1: pagoda keeps its blocks); pagoda also runs it
# dequantized to bf16 (`--quantization none`), and llama.cpp a BF16 conversion if
# LLAMA_GGUF_BF16 names one (`llama-quantize --allow-requantize IN OUT BF16`), the
# like-for-like pair. THREADS (default 2) is given to both; DTYPE (default auto: bf16
# where the CPU has it, else float32) to pagoda on the GGUF as it is.
set -euo pipefail

: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
out=${1:-bench_results/vs_llamacpp}
threads=${THREADS:-2}
gguf=${LLAMA_GGUF:-$(python3 -c 'from pagoda.model_executor.default_model import default_model_path; print(default_model_path())')}
port=8093
mkdir -p "$out"

wait_ready() {
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 1
  done
  echo "server on port $port did not come up" >&2
  return 1
}

stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# Each result file also holds the ones it included, so including the previous
# system's file is enough for the last table to show every system.
mixed_done=()
b1_done=()

# name, then the command that starts the server on $port
run_system() {
  local name=$1
  shift
  "$@" >"$out/$name.server.log" 2>&1 &
  local pid=$!
  wait_ready
  echo "== $name"
  pagoda bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$gguf" --workload mixed \
    --max-concurrency 64 --label "$name" --output-json "$out/$name.mixed.json" --no-progress \
    "${mixed_done[@]}"
  pagoda bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$gguf" --workload uniform \
    --num-prompts 4 --max-concurrency 1 --label "$name B=1" --output-json "$out/$name.b1.json" \
    --no-progress "${b1_done[@]}"
  mixed_done=(--include-json "$out/$name.mixed.json")
  b1_done=(--include-json "$out/$name.b1.json")
  stop "$pid"
}

run_system pagoda-gguf pagoda serve "$gguf" --dtype "${DTYPE:-auto}" --num-threads "$threads" --port "$port"
run_system pagoda-bf16 pagoda serve "$gguf" --dtype bfloat16 --quantization none --num-threads "$threads" --port "$port"
run_system llama.cpp-gguf "$LLAMA_SERVER" -m "$gguf" -t "$threads" -c 53248 -np 64 --port "$port" --host 127.0.0.1
if [[ -n "${LLAMA_GGUF_BF16:-}" ]]; then
  run_system llama.cpp-bf16 "$LLAMA_SERVER" -m "$LLAMA_GGUF_BF16" -t "$threads" -c 53248 -np 64 --port "$port" --host 127.0.0.1
fi
