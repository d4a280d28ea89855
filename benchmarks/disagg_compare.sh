#!/usr/bin/env bash
# Disaggregated prefill/decode vs one instance, side by side on one quiet machine (the default model):
#   single: one instance on both cores, chunked prefill (the default);
#   disagg: a prefill instance on core 0 and a decode instance on core 1 (NixlConnector over loopback), behind
#           `pagedllm proxy`.
# The same load on each (`pagedllm bench mixed-load`): 8 streams decoding while 3,000-token prompts keep arriving;
# then the transfer time of one 3,000-token prompt's blocks (`pagedllm bench kv-transfer`).
#   benchmarks/disagg_compare.sh
#   STREAM_OUT=256 LONG_INTERVAL=3 benchmarks/disagg_compare.sh
# Results: $OUT/mixed_{single,disagg}.json, $OUT/kv_transfer.json, $OUT/disagg_compare.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PY=${PY:-.venv/bin/python}
PAGEDLLM=(.venv/bin/pagedllm)
KV=${KV:-2GiB}
STREAM_OUT=${STREAM_OUT:-384} LONG_INTERVAL=${LONG_INTERVAL:-2}
MIXED=(bench mixed-load --num-streams 8 --stream-output-len "$STREAM_OUT" --long-input-len 3000
       --long-interval-s "$LONG_INTERVAL")
mkdir -p "$OUT"
grep -m1 "model name" /proc/cpuinfo
echo "flags: $(grep -m1 -o -w -E "avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile" /proc/cpuinfo | sort -u | tr "\n" " ")"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null; done; wait 2>/dev/null; PIDS=(); }
trap cleanup EXIT
wait_health() {
  for _ in $(seq 1 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not come up" >&2; return 1
}

# One instance, both cores.
"${PAGEDLLM[@]}" serve --port 8300 --kv-cache-memory "$KV" > "$OUT/single.log" 2>&1 &
PIDS+=($!)
wait_health http://127.0.0.1:8300 && "${PAGEDLLM[@]}" "${MIXED[@]}" --base-url http://127.0.0.1:8300 \
  --output-json "$OUT/mixed_single.json"
cleanup

# Prefill on core 0, decode on core 1, the proxy in front.
OMP_NUM_THREADS=1 taskset -c 0 "${PAGEDLLM[@]}" serve --port 8100 --kv-cache-memory "$KV" \
  --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}' > "$OUT/prefill.log" 2>&1 &
PIDS+=($!)
OMP_NUM_THREADS=1 taskset -c 1 "${PAGEDLLM[@]}" serve --port 8200 --kv-cache-memory "$KV" \
  --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}' > "$OUT/decode.log" 2>&1 &
PIDS+=($!)
"${PAGEDLLM[@]}" proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 \
  > "$OUT/proxy.log" 2>&1 &
PIDS+=($!)
wait_health http://127.0.0.1:8100 && wait_health http://127.0.0.1:8200 && wait_health http://127.0.0.1:8000 && \
  "${PAGEDLLM[@]}" "${MIXED[@]}" --base-url http://127.0.0.1:8000 --output-json "$OUT/mixed_disagg.json"
cleanup

"${PAGEDLLM[@]}" bench kv-transfer --prompt-len 3000 --output-json "$OUT/kv_transfer.json"

$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
single, disagg = (json.load(open(f"{out}/mixed_{k}.json")) for k in ("single", "disagg"))
kv = json.load(open(f"{out}/kv_transfer.json"))
keys = ("median_itl_ms", "p99_itl_ms", "median_long_ttft_ms", "p99_long_ttft_ms", "long_prompts", "failed")
summary = {"single": {k: single[k] for k in keys}, "disagg": {k: disagg[k] for k in keys},
           "p99_itl_disagg_over_single": disagg["p99_itl_ms"] / single["p99_itl_ms"],
           "kv_transfer_3000_tokens_ms": kv["median_ms"], "kv_transfer_us_per_block": kv["median_us_per_block"]}
json.dump(summary, open(f"{out}/disagg_compare.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PYEOF
