#!/usr/bin/env bash
# The GPU check, in one command of a few minutes, on a machine with an NVIDIA GPU (issue: CUDA backend).
# Prepare on the CPU machine first: benchmarks/gpu/prepare.sh (carries wheels + the default model's config).
# Then, on the GPU machine, from the repository root:   bash benchmarks/gpu_check.sh
# Writes logs and JSON under $OUT (default results/gpu). DRY_RUN=1 runs every step at tiny sizes on the CPU.
set -uo pipefail
OUT=${OUT:-results/gpu}
CARRY=${CARRY:-benchmarks/gpu/.carry}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" = 1 ]; then DEVICE=cpu; N_TP=8; N_SERVE=8; CONC=4; ITERS=1; LEN=8; else N_TP=1000; N_SERVE=400; CONC=200; ITERS=5; LEN=128; fi
DTYPE=$([ "$DEVICE" = cuda ] && echo bfloat16 || echo float32)

if [ "$DEVICE" = cuda ]; then
  SITE=/tmp/pagedllm-site
  $PY -m pip install --quiet --no-deps --target "$SITE" "$CARRY"/wheels/*.whl
  export PYTHONPATH="$PWD:$SITE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
else
  export PYTHONPATH="$PWD"
fi
M=/tmp/pagedllm-random-smollm2
[ -d "$M" ] || $PY benchmarks/gpu/make_random_model.py "$CARRY/smollm2-config" "$M" "$DTYPE" || exit 1

step() {  # step NAME SECONDS CMD...: run, keep the log, say how it went
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log"
}

# 1. Kernels and engine on the device: Triton attention and fused ops compiled for real, fidelity vs
#    transformers, batched == solo, the graph runner's padding.
#    On the GPU the CPU kernels are off: the few CPU-side checks there do not need them, and a C++ build (where
#    the image has a compiler and ninja) would spend device time.
step tests 240 env PAGEDLLM_TEST_DEVICE="$DEVICE" TRITON_INTERPRET=$([ "$DEVICE" = cuda ] && echo 0 || echo 1) \
  PAGEDLLM_CPU_KERNELS=$([ "$DEVICE" = cuda ] && echo 0 || echo 1) \
  $PY -m pytest -q -x tests/attention/test_triton_paged_attention.py tests/kernels/test_triton_ops.py \
  tests/quantization/test_triton_quant_matmul.py \
  tests/engine/test_device_engine.py tests/worker/test_cuda_graph_runner.py
# 1b. The MoE kernels (grouped matmul over rows sorted by expert, the combine) and a tiny MoE engine on the device.
step tests_moe 180 env PAGEDLLM_TEST_DEVICE="$DEVICE" TRITON_INTERPRET=$([ "$DEVICE" = cuda ] && echo 0 || echo 1) \
  PAGEDLLM_CPU_KERNELS=$([ "$DEVICE" = cuda ] && echo 0 || echo 1) $PY -m pytest -q tests/kernels/test_triton_moe.py
# 2. Batch-1 latency with and without CUDA graphs.
ENGINE=(--model "$M" --device "$DEVICE" --dtype "$DTYPE" --disable-log-stats)
step latency_b1 180 $PY -m pagedllm bench latency "${ENGINE[@]}" --batch-size 1 --input-len $LEN --output-len $LEN \
  --num-iters $ITERS --output-json "$OUT/latency_b1.json"
step latency_b1_eager 180 $PY -m pagedllm bench latency "${ENGINE[@]}" --enforce-eager --batch-size 1 \
  --input-len $LEN --output-len $LEN --num-iters $ITERS --output-json "$OUT/latency_b1_eager.json"
# 2b. Quantized weights on the GPU (the Triton weight-only kernel): int4 groups of 32 and int8, batch 1.
for q in int4 int8; do
  step "latency_b1_$q" 120 $PY -m pagedllm bench latency "${ENGINE[@]}" --quantization $q --batch-size 1 \
    --input-len $LEN --output-len $LEN --num-iters $ITERS --output-json "$OUT/latency_b1_$q.json"
done
# 3. Throughput, 1,000 x 128/128 with 512 sequences, and Hugging Face generate() at batch 200 beside it.
step throughput 240 $PY -m pagedllm bench throughput "${ENGINE[@]}" --max-num-seqs 512 --num-prompts $N_TP \
  --input-len $LEN --output-len $LEN --output-json "$OUT/throughput.json"
step throughput_hf 240 $PY -m pagedllm bench throughput --backend hf "${ENGINE[@]}" --hf-batch-sizes 200 \
  --num-prompts $((N_TP < 200 ? N_TP : 200)) --input-len $LEN --output-len $LEN --output-json "$OUT/throughput_hf.json"
# 4. Share of the step the GPU is busy (torch profiler), batch 1 and 64.
step profile_b1 120 $PY benchmarks/gpu/profile_decode.py "$M" --device "$DEVICE" --dtype "$DTYPE" --batch-size 1 \
  --output-json "$OUT/profile_b1.json"
step profile_b64 120 $PY benchmarks/gpu/profile_decode.py "$M" --device "$DEVICE" --dtype "$DTYPE" --batch-size 64 \
  --output-json "$OUT/profile_b64.json"
# 5. The server with 200 concurrent streams.
PORT=${PORT:-8011}
$PY -m pagedllm serve "$M" --device "$DEVICE" --dtype "$DTYPE" --port $PORT --max-num-seqs 256 > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || echo "serve: the server was not healthy after 300 s" | tee -a "$OUT/summary.txt"
step serve 240 $PY -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --model "$M" --tokenizer "$M" \
  --num-prompts $N_SERVE --max-concurrency $CONC --input-len $LEN --output-len $LEN --output-json "$OUT/serve.json"
kill $SERVER; wait $SERVER 2> /dev/null
echo "results in $OUT"; cat "$OUT/summary.txt"
