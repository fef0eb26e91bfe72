#!/usr/bin/env bash
# The families at real sizes, pagoda against llama.cpp's server on the same GGUF file
# with the same client (`pagoda bench serve`, token ids sent as they are), one server
# at a time on this machine:
#
#   LLAMA_SERVER=/path/to/llama-server benchmarks/families_vs_llamacpp.sh FILE.gguf [...]
#
# Files from benchmarks/real_size_models.py (random weights of released configs,
# converted and quantized by llama.cpp's own tools). Passes per file and system, after
# one warm-up request: batch 1 (4 `uniform` requests, 128 in / 128 out, one in flight:
# TPOT) and 16 at once (16 `uniform` requests). llama.cpp runs 16 slots of 1,024
# tokens; pagoda its defaults with max_model_len 4096. THREADS (default 2) for both;
# OUT_DIR for results.
set -euo pipefail

: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
threads=${THREADS:-2}
out=${OUT_DIR:-bench_results/families_vs_llamacpp}
port=8094
mkdir -p "$out"

wait_ready() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 1
  done
  echo "server on port $port did not come up" >&2
  return 1
}

stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# file, system name, then the command that starts the server on $port
run_system() {
  local file=$1 name=$2
  shift 2
  local stem
  stem=$(basename "$file" .gguf)
  "$@" >"$out/$stem.$name.server.log" 2>&1 &
  local pid=$!
  wait_ready
  echo "== $stem $name" >&2
  local common=(--base-url "http://127.0.0.1:$port" --endpoint /v1/completions --prompt-ids
                --tokenizer "$file" --workload uniform --no-progress --label "$name")
  pagoda bench serve "${common[@]}" --num-prompts 1 --max-concurrency 1 --seed 7 >/dev/null
  pagoda bench serve "${common[@]}" --num-prompts 4 --max-concurrency 1 \
    --output-json "$out/$stem.$name.b1.json" >/dev/null
  pagoda bench serve "${common[@]}" --num-prompts 16 --max-concurrency 16 \
    --output-json "$out/$stem.$name.c16.json" >/dev/null
  stop "$pid"
}

for file in "$@"; do
  run_system "$file" pagoda pagoda serve "$file" --dtype bfloat16 --num-threads "$threads" \
    --max-model-len 4096 --port "$port"
  run_system "$file" llama.cpp "$LLAMA_SERVER" -m "$file" -t "$threads" -c 16384 -np 16 \
    --port "$port" --host 127.0.0.1
done

python3 - "$out" "$@" <<'PY'
import json, os, sys

out, files = sys.argv[1], sys.argv[2:]
rows = []
print(f"{'file':<24} {'TPOT pagoda':>12} {'llama.cpp':>10} {'x':>5} "
      f"{'16: tok/s pagoda':>17} {'llama.cpp':>10} {'x':>5}")
for file in files:
    stem = os.path.basename(file).removesuffix(".gguf")
    res = {}
    for system in ("pagoda", "llama.cpp"):
        for run in ("b1", "c16"):
            with open(f"{out}/{stem}.{system}.{run}.json") as f:
                res[system, run] = json.load(f)["results"][0]
    tpot = {s: res[s, "b1"]["tpot_ms"]["mean"] for s in ("pagoda", "llama.cpp")}
    tput = {s: res[s, "c16"]["output_throughput"] for s in ("pagoda", "llama.cpp")}
    rows.append({"file": stem, "tpot_ms": tpot, "c16_output_tok_s": tput,
                 "b1_speedup": tpot["llama.cpp"] / tpot["pagoda"],
                 "c16_speedup": tput["pagoda"] / tput["llama.cpp"]})
    print(f"{stem:<24} {tpot['pagoda']:>12.1f} {tpot['llama.cpp']:>10.1f} "
          f"{rows[-1]['b1_speedup']:>5.2f} {tput['pagoda']:>17.1f} {tput['llama.cpp']:>10.1f} "
          f"{rows[-1]['c16_speedup']:>5.2f}")
from pagoda.bench.report import machine_info

with open(f"{out}/summary.json", "w") as f:
    json.dump({"command": "benchmarks/families_vs_llamacpp.sh " + " ".join(files),
               "machine": machine_info(), "threads": os.environ.get("THREADS", "2"),
               "results": rows}, f, indent=2)
PY
