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
# TPOT) and N at once (N `uniform` requests) for each N in AT_ONCE (default "16";
# "16 64" adds 64 at once). llama.cpp runs as many slots of 1,024 tokens as the largest
# N; pagoda its defaults with max_model_len 4096 and as many sequences, in DTYPE
# (default auto: bf16 where the CPU has it, else float32). THREADS (default 2) for
# both; OUT_DIR for results.
set -euo pipefail

: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
threads=${THREADS:-2}
at_once=${AT_ONCE:-16}
dtype=${DTYPE:-auto}
slots=$(printf '%s\n' $at_once | sort -n | tail -1)
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
  for n in $at_once; do
    pagoda bench serve "${common[@]}" --num-prompts "$n" --max-concurrency "$n" \
      --output-json "$out/$stem.$name.c$n.json" >/dev/null
  done
  stop "$pid"
}

for file in "$@"; do
  run_system "$file" pagoda pagoda serve "$file" --dtype "$dtype" --num-threads "$threads" \
    --max-model-len 4096 --max-num-seqs "$slots" --port "$port"
  run_system "$file" llama.cpp "$LLAMA_SERVER" -m "$file" -t "$threads" \
    -c $((slots * 1024)) -np "$slots" --port "$port" --host 127.0.0.1
done

python3 - "$out" "$at_once" "$@" <<'PY'
import json, os, sys

out, at_once, files = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
rows = []
print(f"{'file':<24} {'TPOT pagoda':>12} {'llama.cpp':>10} {'x':>5}", end="")
for n in at_once:
    print(f" {n + ': tok/s pagoda':>17} {'llama.cpp':>10} {'x':>5}", end="")
print()
for file in files:
    stem = os.path.basename(file).removesuffix(".gguf")
    res = {}
    for system in ("pagoda", "llama.cpp"):
        for run in ["b1"] + [f"c{n}" for n in at_once]:
            with open(f"{out}/{stem}.{system}.{run}.json") as f:
                res[system, run] = json.load(f)["results"][0]
    tpot = {s: res[s, "b1"]["tpot_ms"]["mean"] for s in ("pagoda", "llama.cpp")}
    row = {"file": stem, "tpot_ms": tpot, "b1_speedup": tpot["llama.cpp"] / tpot["pagoda"]}
    line = f"{stem:<24} {tpot['pagoda']:>12.1f} {tpot['llama.cpp']:>10.1f} {row['b1_speedup']:>5.2f}"
    for n in at_once:
        tput = {s: res[s, f"c{n}"]["output_throughput"] for s in ("pagoda", "llama.cpp")}
        row[f"c{n}_output_tok_s"] = tput
        row[f"c{n}_speedup"] = tput["pagoda"] / tput["llama.cpp"]
        line += f" {tput['pagoda']:>17.1f} {tput['llama.cpp']:>10.1f} {row[f'c{n}_speedup']:>5.2f}"
    rows.append(row)
    print(line)
from pagoda.bench.report import machine_info

with open(f"{out}/summary.json", "w") as f:
    json.dump({"command": "benchmarks/families_vs_llamacpp.sh " + " ".join(files),
               "machine": machine_info(), "threads": os.environ.get("THREADS", "2"),
               "at_once": at_once,
               "results": rows}, f, indent=2)
PY
