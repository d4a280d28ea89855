#!/usr/bin/env bash
# Quantization side by side on the default model (SmolLM2-135M Q4_1 GGUF), one scheme after the other on a
# quiet machine: batch-1 decode (128 in / 128 out, ms per output token) and 200 x 128/128 throughput.
#   benchmarks/quant_compare.sh                       # every scheme, both steps
#   SCHEMES="none gguf" STEPS=latency benchmarks/quant_compare.sh
# "none" is the GGUF dequantized to float32, "gguf" the default (its blocks kept quantized). Results go to
# $OUT/quant_*.json; the kernel micro-benchmark (ours vs torch's int8/int4 ops) goes to $OUT/quant_matmul.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PY=${PY:-.venv/bin/python}
SCHEMES=${SCHEMES:-"none gguf fp8 int8 w8a8 int4"}
STEPS=${STEPS:-"latency tp matmul"}
COMMON=(--dtype float32 --kv-cache-memory 4GiB)
IN=${IN:-128} OUTLEN=${OUTLEN:-128} PROMPTS=${PROMPTS:-200} ITERS=${ITERS:-5}  # smaller: a dry run
mkdir -p "$OUT"

flag() { echo "--quantization $1"; }

for step in $STEPS; do
  for s in $SCHEMES; do
    case $step in
      latency)
        # shellcheck disable=SC2046
        $PY -m pagedllm bench latency "${COMMON[@]}" $(flag "$s") --input-len "$IN" --output-len "$OUTLEN" \
          --batch-size 1 --num-iters "$ITERS" --num-iters-warmup 1 --output-json "$OUT/quant_latency_$s.json" --disable-tqdm ;;
      tp)
        # shellcheck disable=SC2046
        $PY -m pagedllm bench throughput "${COMMON[@]}" $(flag "$s") --num-prompts "$PROMPTS" --input-len "$IN" \
          --output-len "$OUTLEN" --output-json "$OUT/quant_tp_$s.json" --disable-tqdm ;;
    esac
  done
  if [ "$step" = matmul ]; then
    PYTHONPATH=. $PY benchmarks/quant_matmul.py --rows 1 4 16 64 200 --repeat "$((ITERS * 20))" \
      | tee "$OUT/quant_matmul.txt"
  fi
done
