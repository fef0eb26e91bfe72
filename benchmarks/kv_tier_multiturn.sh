#!/usr/bin/env bash
# `multiturn` (16 conversations of 4 turns, each turn resending the history; about
# 26k tokens of conversation KV in all) against one server whose pool holds a part
# of it (--kv-cache-memory-bytes, 256 MiB: about 11k tokens of SmolLM2), without the
# disk tier and then with it, fresh servers, 4 requests in flight. TTFT counts the
# wait for one of the 4 slots (as the user's would); ttft_after_send_ms leaves it out.
#
#   benchmarks/kv_tier_multiturn.sh [OUT_DIR] [-- extra engine flags]
set -euo pipefail

out=${1:-docs/perf/kv_tier_multiturn}
shift || true
[[ ${1:-} == "--" ]] && shift
port=8095
pool=$((256 << 20))
mkdir -p "$out"
gguf=$(python3 -c 'from pagoda.model_executor.default_model import default_model_path; print(default_model_path())')
tier=$(mktemp -d)
trap 'rm -rf "$tier"' EXIT

run() {  # label, then engine flags
  local label=$1
  shift
  pagoda serve --port "$port" --kv-cache-memory-bytes "$pool" --disable-uvicorn-access-log "$@" \
    >"$out/$label.server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  pagoda bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$gguf" --workload multiturn \
    --prompt-ids --max-concurrency 4 --label "$label" --no-progress --output-json "$out/$label.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^pagoda:(prefix_cache|kv_tier)' >"$out/$label.metrics.txt" || true
  kill -TERM "$server_pid"
  wait "$server_pid" || true
}

run without "$@"
run with --kv-offload-dir "$tier" "$@"

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = {k: json.load(open(f"{out}/{k}.json"))["results"][0] for k in ("without", "with")}
for k, r in rows.items():
    print(f"{k:8s} TTFT p50 {r['ttft_ms']['median']:8.0f} ms (from the send {r['ttft_after_send_ms']['median']:6.0f} ms)  "
          f"TPOT mean {r['tpot_ms']['mean']:6.1f} ms  out tok/s {r['output_throughput']:6.1f}  "
          f"duration {r['duration_s']:6.1f} s")
for key in ("ttft_ms", "ttft_after_send_ms"):
    ratio = rows["with"][key]["median"] / rows["without"][key]["median"]
    print(f"{key} p50 with the tier / without: {ratio:.3f}")
PY
