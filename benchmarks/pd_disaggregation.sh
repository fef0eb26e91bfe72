#!/usr/bin/env bash
# Prefill/decode disaggregation against colocated serving, on `mixed` (32 requests,
# 16 in flight, SmolLM2 Q4_1), through the same client:
#   colocated: one `pagoda serve` (every core);
#   dp2:       `pagoda serve --data-parallel-size 2` (two replicas, a core each, behind
#              the prefix router: the same split of cores as pd, without the hand-off);
#   pd:        a producer and a consumer on one disk tier (--kv-offload-dir), each
#              with half the cores (--num-threads), behind `pagoda router --policy pd`.
# On one machine the two replicas split its cores, so this measures what the split
# and the hand-off cost, not what a second machine would add.
#
#   benchmarks/pd_disaggregation.sh [OUT_DIR]
set -euo pipefail

out=${1:-docs/perf/pd_disaggregation}
mkdir -p "$out"
gguf=$(python3 -c 'from pagoda.model_executor.default_model import default_model_path; print(default_model_path())')
tier=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; rm -rf "$tier"; }
trap cleanup EXIT
half=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))

up() {  # port: wait for /health
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done
  echo "port $1 did not come up" >&2; exit 1
}

bench() {  # label, port
  pagoda bench serve --base-url "http://127.0.0.1:$2" --tokenizer "$gguf" --workload mixed \
    --num-prompts 32 --max-concurrency 16 --label "$1" --no-progress --output-json "$out/$1.json"
}

pagoda serve --port 8101 --disable-uvicorn-access-log >"$out/colocated.server.log" 2>&1 &
pids+=($!); up 8101
bench colocated 8101
kill -TERM "${pids[0]}"; wait "${pids[0]}" || true; pids=()

pagoda serve --port 8105 --data-parallel-size 2 --disable-uvicorn-access-log >"$out/dp2.server.log" 2>&1 &
pids+=($!); up 8105
bench dp2 8105
kill -TERM "${pids[0]}"; wait "${pids[0]}" || true; pids=()

transfer='{"kv_role": "kv_producer"}'
pagoda serve --port 8102 --num-threads "$half" --kv-offload-dir "$tier" --kv-transfer-config "$transfer" \
  --disable-uvicorn-access-log >"$out/producer.server.log" 2>&1 &
pids+=($!)
pagoda serve --port 8103 --num-threads "$half" --kv-offload-dir "$tier" \
  --kv-transfer-config '{"kv_role": "kv_consumer"}' --disable-uvicorn-access-log >"$out/consumer.server.log" 2>&1 &
pids+=($!)
up 8102; up 8103
pagoda router --port 8104 --policy pd --prefill http://127.0.0.1:8102 --decode http://127.0.0.1:8103 \
  >"$out/router.log" 2>&1 &
pids+=($!); up 8104
bench pd 8104
curl -s http://127.0.0.1:8103/metrics | grep -E '^pagoda:(prefix_cache|kv_tier)' >"$out/consumer.metrics.txt" || true

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = {k: json.load(open(f"{out}/{k}.json"))["results"][0] for k in ("colocated", "dp2", "pd")}
for k, r in rows.items():
    print(f"{k:10s} TTFT p50 {r['ttft_ms']['median']:7.0f} ms  mean {r['ttft_ms']['mean']:7.0f} ms  "
          f"TPOT mean {r['tpot_ms']['mean']:6.1f} ms  out tok/s {r['output_throughput']:6.1f}")
PY
