#!/usr/bin/env bash
# The CPU kernel autotuner on and off, side by side on the default model (SmolLM2-135M Q4_1 GGUF kept
# quantized), alternating runs on a quiet machine: throughput at N x IN/OUT and batch-1 decode.
#   benchmarks/autotune_compare.sh                   # 2 rounds of: throughput off/on, latency off/on
#   ROUNDS=1 PROMPTS=64 benchmarks/autotune_compare.sh
# The first "on" run measures the table (saved in $PAGEDLLM_CACHE_DIR, here $OUT/autotune_cache) and logs it;
# later ones read it. Results: $OUT/autotune_{tp,latency}_{off,on}_<round>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-2}
IN=${IN:-128} OUTLEN=${OUTLEN:-128} PROMPTS=${PROMPTS:-200} ITERS=${ITERS:-3}
export PAGEDLLM_CACHE_DIR=${PAGEDLLM_CACHE_DIR:-$OUT/autotune_cache}
mkdir -p "$OUT"
grep -m1 "model name" /proc/cpuinfo
echo "flags: $(grep -m1 -o -w -E "avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile" /proc/cpuinfo | sort -u | tr "\n" " ")"

for round in $(seq 1 "$ROUNDS"); do
  for mode in off on; do
    $PY -m pagedllm bench throughput --cpu-kernel-autotune "$mode" --kv-cache-memory 2GiB --num-prompts "$PROMPTS" \
      --input-len "$IN" --output-len "$OUTLEN" --output-json "$OUT/autotune_tp_${mode}_$round.json" --disable-tqdm
  done
  for mode in off on; do
    $PY -m pagedllm bench latency --cpu-kernel-autotune "$mode" --kv-cache-memory 2GiB --input-len 32 \
      --output-len "$OUTLEN" --batch-size 1 --num-iters "$ITERS" --num-iters-warmup 1 \
      --output-json "$OUT/autotune_latency_${mode}_$round.json" --disable-tqdm
  done
done
