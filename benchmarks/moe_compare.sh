#!/usr/bin/env bash
# The MoE benchmark (docs/models.md, "Mixture of experts"), each run alone on the machine, one after the other:
#   benchmarks/moe_compare.sh                 # every step
#   STEPS="decode" benchmarks/moe_compare.sh
# Steps:
#   decode: one decode stream (batch 1, 128 prompt / 128 output tokens) of the random Qwen3-MoE (32 experts, top-4)
#           vs the dense Qwen3 with the same active parameters, bf16 and int8 (int8 runs float32 activations):
#           latency JSONs, key avg_tpot_ms = decode ms/token; the goal is MoE <= 1.3x dense.
#   tp:     200 x 128/128 on the MoE, float32: pagedllm vs transformers' generate (batches of $HF_BATCHES, default 32).
#   graphs: one float32 decode stream of a random Mixtral (same shapes) and its dense Llama, with CPU step graphs
#           (the default) and with --enforce-eager: what recording the MoE decode step (moe_route.cpp) gives.
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

step_graphs() {
  [ -f "$DIR-mixtral-float32/moe/config.json" ] || $PY benchmarks/make_moe_folders.py "$DIR-mixtral-float32" float32 mixtral || exit 1
  for model in moe dense; do
    for mode in graphs eager; do
      extra=(); [ "$mode" = eager ] && extra=(--enforce-eager)
      "${OURS[@]}" bench latency --model "$DIR-mixtral-float32/$model" --dtype float32 --kv-cache-memory 2GiB \
        --input-len 128 --output-len 128 --batch-size 1 --num-iters 5 --num-iters-warmup 1 "${extra[@]}" \
        --output-json "$OUT/moe_graphs_${model}_${mode}.json"
    done
  done
}

step_tp() {
  "${OURS[@]}" bench throughput --model "$DIR-float32/moe" --dtype float32 --kv-cache-memory 4GiB \
    --input-len 128 --output-len 128 --num-prompts 200 --output-json "$OUT/moe_tp_pagedllm.json"
  "${OURS[@]}" bench throughput --model "$DIR-float32/moe" --dtype float32 --backend hf --hf-batch-sizes "${HF_BATCHES:-32}" \
    --input-len 128 --output-len 128 --num-prompts 200 --output-json "$OUT/moe_tp_hf.json"
  "${OURS[@]}" bench throughput --model "$DIR-float32/dense" --dtype float32 --kv-cache-memory 4GiB \
    --input-len 128 --output-len 128 --num-prompts 200 --output-json "$OUT/moe_tp_dense.json"
}

summary() {  # the numbers the goals are stated in, from whichever JSONs the steps wrote
  $PY - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def read(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
for kind in ("bf16", "int8"):
    moe, dense = read(f"moe_decode_moe_{kind}.json"), read(f"moe_decode_dense_{kind}.json")
    if moe and dense:
        print(f"decode {kind}: MoE {moe['avg_tpot_ms']:.2f} ms/token, dense {dense['avg_tpot_ms']:.2f} ms/token, "
              f"ratio {moe['avg_tpot_ms'] / dense['avg_tpot_ms']:.2f} (goal <= 1.3)")
for model in ("moe", "dense"):
    g, e = read(f"moe_graphs_{model}_graphs.json"), read(f"moe_graphs_{model}_eager.json")
    if g and e:
        print(f"mixtral-shaped {model} float32 decode: step graphs {g['avg_tpot_ms']:.2f} ms/token, eager "
              f"{e['avg_tpot_ms']:.2f} ms/token")
tp, hf, dense = read("moe_tp_pagedllm.json"), read("moe_tp_hf.json"), read("moe_tp_dense.json")
if tp:
    print(f"200 x 128/128 MoE: {tp['output_tokens_per_second']:.1f} output tok/s")
    if dense:
        print(f"  dense: {dense['output_tokens_per_second']:.1f} output tok/s; MoE/dense "
              f"{tp['output_tokens_per_second'] / dense['output_tokens_per_second']:.2f} (goal >= 0.6)")
if hf:
    print("transformers generate:", json.dumps(hf.get("per_batch_size", hf))[:300])
PY
}

for step in $STEPS; do
  echo "== $step"
  "step_$step" || echo "step $step failed" >&2
done
summary
