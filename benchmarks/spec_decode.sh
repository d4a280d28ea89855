#!/usr/bin/env bash
# Speculative decoding side by side (docs/speculative_decoding.md), one engine at a time:
#   benchmarks/spec_decode.sh                       # default model, the full run
#   MODEL=/path IN=64 OUTLEN=16 ITERS=1 NPROMPTS=8 benchmarks/spec_decode.sh   # a dry run
# 1. batch-1 ms per output token, greedy, on a grounded workload (repeat a passage) and on random prompts,
#    speculation off / ngram / layer_skip (and draft_model when DRAFT=/path/to/draft is set);
# 2. throughput at 64 concurrent requests (temperature 1), off / ngram (default: drafting off above 8
#    requests per step) / ngram never off.
# Results: $OUT/spec-*.json and a table on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PAGEDLLM=${PAGEDLLM:-.venv/bin/pagedllm}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
DTYPE=${DTYPE:-float32}
IN=${IN:-256}
OUTLEN=${OUTLEN:-128}
ITERS=${ITERS:-3}
NPROMPTS=${NPROMPTS:-64}
K=${K:-4}
DRAFT_LAYERS=${DRAFT_LAYERS:-8}
mkdir -p "$OUT"
COMMON=(--model "$MODEL" --dtype "$DTYPE" --kv-cache-memory 4GiB --disable-log-stats)

declare -A METHODS=(
  [off]=""
  [ngram]="{\"method\": \"ngram\", \"num_speculative_tokens\": $K}"
  [layer_skip]="{\"method\": \"layer_skip\", \"num_draft_layers\": $DRAFT_LAYERS, \"num_speculative_tokens\": 3}"
)
[ -n "${DRAFT:-}" ] && METHODS[draft_model]="{\"method\": \"draft_model\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": $K}"

for ds in grounded random; do
  for name in "${!METHODS[@]}"; do
    spec=()
    [ -n "${METHODS[$name]}" ] && spec=(--speculative-config "${METHODS[$name]}")
    echo "== latency $ds $name"
    $PAGEDLLM bench latency "${COMMON[@]}" --dataset "$ds" --input-len "$IN" --output-len "$OUTLEN" \
      --batch-size 1 --temperature 0 --num-iters "$ITERS" --num-iters-warmup 1 --disable-tqdm "${spec[@]}" \
      --output-json "$OUT/spec-latency-$ds-$name.json" || echo "latency $ds $name failed"
  done
done

NGRAM="{\"method\": \"ngram\", \"num_speculative_tokens\": $K}"
NGRAM_ALWAYS="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"disable_by_batch_size\": null}"
for ds in random grounded; do
  for name in off ngram ngram_always; do
    spec=()
    [ "$name" = ngram ] && spec=(--speculative-config "$NGRAM")
    [ "$name" = ngram_always ] && spec=(--speculative-config "$NGRAM_ALWAYS")
    echo "== throughput $ds $name ($NPROMPTS concurrent)"
    $PAGEDLLM bench throughput "${COMMON[@]}" --dataset "$ds" --num-prompts "$NPROMPTS" --input-len "$IN" \
      --output-len "$OUTLEN" --max-num-seqs "$NPROMPTS" --disable-tqdm "${spec[@]}" \
      --output-json "$OUT/spec-throughput-$ds-$name.json" || echo "throughput $ds $name failed"
  done
done

$PY - "$OUT" <<'PYEOF'
import glob, json, os, sys
out = sys.argv[1]
print(f"{'latency (batch 1, greedy)':32s} {'ms/token':>9s} {'accept len':>10s}")
for path in sorted(glob.glob(os.path.join(out, "spec-latency-*.json"))):
    r = json.load(open(path))
    name = os.path.basename(path)[len("spec-latency-"):-5]
    print(f"{name:32s} {r['ms_per_output_token']:9.2f} {r.get('mean_acceptance_length', 0):10.2f}")
print(f"{'throughput':32s} {'out tok/s':>9s}")
for path in sorted(glob.glob(os.path.join(out, "spec-throughput-*.json"))):
    r = json.load(open(path))
    name = os.path.basename(path)[len("spec-throughput-"):-5]
    print(f"{name:32s} {r['output_tokens_per_second']:9.1f}")
PYEOF
