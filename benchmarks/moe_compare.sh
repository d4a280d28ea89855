#!/usr/bin/env bash
# The MoE benchmark (docs/models.md, "Mixture of experts"), each run alone on the machine, one after the other:
#   benchmarks/moe_compare.sh                 # every step
#   STEPS="decode" benchmarks/moe_compare.sh
# Steps:
#   decode: one decode stream (batch 1, 128 prompt / 128 output tokens) of the random Qwen3-MoE (32 experts, top-4)
#           vs the dense Qwen3 with the same active parameters, bf16 and int8 (int8 runs float32 activations):
#           latency JSONs -> ms/token; the goal is MoE <= 1.3x dense.
#   tp:     200 x 128/128 on the MoE, float32: pagedllm vs transformers' generate (batches of 8 and 32).
# Results go to $OUT/moe_*.json. The folders are written once by benchmarks/make_moe_folders.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PY=${PY:-.venv/bin/python}
OURS=(${OURS:-.venv/bin/pagedllm})
DIR=${MOE_DIR:-$OUT/moe-bench}
STEPS=${STEPS:-"decode tp"}
mkdir -p "$OUT"

for dtype in float32 bfloat16; do
  [ -f "$DIR-$dtype/moe/config.json" ] || $PY benchmarks/make_moe_folders.py "$DIR-$dtype" "$dtype" || exit 1
done

step_decode() {
  for model in moe dense; do
    "${OURS[@]}" bench latency --model "$DIR-bfloat16/$model" --dtype bfloat16 --kv-cache-memory 2GiB \
      --input-len 128 --output-len 128 --batch-size 1 --num-iters 5 --num-iters-warmup 1 \
      --output-json "$OUT/moe_decode_${model}_bf16.json"
    "${OURS[@]}" bench latency --model "$DIR-float32/$model" --dtype float32 --quantization int8 \
      --kv-cache-memory 2GiB --input-len 128 --output-len 128 --batch-size 1 --num-iters 5 --num-iters-warmup 1 \
      --output-json "$OUT/moe_decode_${model}_int8.json"
  done
}

step_tp() {
  "${OURS[@]}" bench throughput --model "$DIR-float32/moe" --dtype float32 --kv-cache-memory 4GiB \
    --input-len 128 --output-len 128 --num-prompts 200 --output-json "$OUT/moe_tp_pagedllm.json"
  "${OURS[@]}" bench throughput --model "$DIR-float32/moe" --dtype float32 --backend hf --hf-batch-sizes 8,32 \
    --input-len 128 --output-len 128 --num-prompts 200 --output-json "$OUT/moe_tp_hf.json"
  "${OURS[@]}" bench throughput --model "$DIR-float32/dense" --dtype float32 --kv-cache-memory 4GiB \
    --input-len 128 --output-len 128 --num-prompts 200 --output-json "$OUT/moe_tp_dense.json"
}

for step in $STEPS; do
  echo "== $step"
  "step_$step" || echo "step $step failed" >&2
done
