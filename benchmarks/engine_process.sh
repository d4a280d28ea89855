#!/usr/bin/env bash
# The engine-process boundary and data-parallel routing, side by side in one run (docs/performance.md):
#   benchmarks/engine_process.sh                # both steps
#   STEPS=boundary benchmarks/engine_process.sh
# Steps:
#   boundary: 200 x 128/128 through `pagedllm serve` (bench serve, unlimited rate), the engine core on a thread
#             of the server (PAGEDLLM_ENABLE_MULTIPROCESSING=0) vs in its own process (the default).
#   routing:  a shared-prefix workload (8 system prompts of 1,500 tokens x 32 users, 64-token questions, 32-token
#             answers, Poisson arrivals) on DP=1, DP=2 prefix-aware and DP=2 round robin.
# Each server runs alone on the machine, one after the other, on the default model. Results go to $OUT/*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
STEPS=${STEPS:-"boundary routing"}
PORT=${PORT:-8765}
KV=${KV:-2GiB}
RATE=${RATE:-4}
mkdir -p "$OUT"
PAGEDLLM=.venv/bin/pagedllm
URL="http://127.0.0.1:$PORT"

serve() {  # serve NAME ENV... -- ARGS...: start a server, wait until healthy
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" "$PAGEDLLM" serve --host 127.0.0.1 --port "$PORT" --kv-cache-memory "$KV" --dtype float32 \
    --max-model-len 4096 --uvicorn-log-level warning --disable-log-stats "$@" > "$OUT/$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 600); do curl -sf "$URL/health" >/dev/null && return 0; sleep 1; done
  echo "server $name did not come up; see $OUT/$name.log" >&2; kill "$SERVER"; return 1
}

stop() { kill -TERM "$SERVER"; wait "$SERVER" 2>/dev/null; }

if [[ " $STEPS " == *" boundary "* ]]; then
  for mode in thread process; do
    flag=1; [ "$mode" = thread ] && flag=0
    serve "boundary-$mode" PAGEDLLM_ENABLE_MULTIPROCESSING=$flag -- || continue
    "$PAGEDLLM" bench serve --base-url "$URL" --num-prompts 200 --input-len 128 --output-len 128 \
      --disable-tqdm --output-json "$OUT/boundary-$mode.json" | tail -n 25
    stop
    grep -h "us each" "$OUT/boundary-$mode.log" || true
  done
fi

if [[ " $STEPS " == *" routing "* ]]; then
  WORKLOAD=(--num-prompts 256 --prefix-len 1500 --num-prefixes 8 --input-len 64 --output-len 32
            --request-rate "$RATE" --disable-tqdm)
  for setup in "dp1:--data-parallel-size 1" "dp2-prefix:--data-parallel-size 2" \
               "dp2-rr:--data-parallel-size 2 --data-parallel-routing round-robin"; do
    name=${setup%%:*}; read -r -a args <<< "${setup#*:}"
    serve "routing-$name" -- "${args[@]}" || continue
    "$PAGEDLLM" bench serve --base-url "$URL" "${WORKLOAD[@]}" --output-json "$OUT/routing-$name.json" | tail -n 25
    stop
  done
fi
