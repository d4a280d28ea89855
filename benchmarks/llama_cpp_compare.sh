#!/usr/bin/env bash
# One decode stream on the default GGUF (SmolLM2-135M Q4_1), llama.cpp vs pagedllm, back to back on one
# quiet machine, both on 2 threads: ms per generated token with 128 tokens of context before the first.
#
# llama.cpp is never a dependency: build its llama-bench from the llama-cpp-python source distribution,
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
#   cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
#     -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-bench      # ~10 minutes
# then: LLAMA_BENCH=/path/to/build/bin/llama-bench benchmarks/llama_cpp_compare.sh
# Output: $OUT/llama_cpp_tg.json (llama-bench's JSON), $OUT/pagedllm_gguf_latency.json, and a summary line.
# Extra pagedllm flags go in PAGEDLLM_FLAGS (e.g. "--kv-cache-dtype bfloat16", like for like with llama.cpp's f16
# KV cache; "--quantization gguf" where it is not the default).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PY=${PY:-.venv/bin/python}
REPS=${REPS:-5}
: "${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary (see the comment at the top)}"
mkdir -p "$OUT"
GGUF=$($PY -c "from pagedllm.model_executor.loader.model_source import find_model_source as f; print(f('smollm2').gguf_file)")
echo "GGUF: $GGUF"

# llama.cpp: 128 generated tokens after a 128-token context (-d), 2 threads, REPS repetitions. On the Intel
# Xeon kind its -d crashes (the prompt pass of a native build), so there it times generation from an empty
# context: a few % in llama.cpp's favour at this length.
"$LLAMA_BENCH" -m "$GGUF" -t 2 -p 0 -n 128 -d 128 -r "$REPS" -o json > "$OUT/llama_cpp_tg.json" || {
  echo "llama-bench -d 128 failed; timing generation without the 128-token context"
  "$LLAMA_BENCH" -m "$GGUF" -t 2 -p 0 -n 128 -r "$REPS" -o json > "$OUT/llama_cpp_tg.json"
}

# pagedllm: batch 1, 128 prompt tokens, 128 generated, greedy.
# shellcheck disable=SC2086
$PY -m pagedllm bench latency --model "$GGUF" ${PAGEDLLM_FLAGS:-} --input-len 128 --output-len 128 --batch-size 1 \
  --temperature 0 --num-iters "$REPS" --num-iters-warmup 1 --disable-tqdm --output-json "$OUT/pagedllm_gguf_latency.json"

$PY - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
llama = json.load(open(f"{out}/llama_cpp_tg.json"))
tg = [r for r in llama if r.get("n_gen", 0) > 0][0]
llama_ms = 1000.0 / tg["avg_ts"]
ours = json.load(open(f"{out}/pagedllm_gguf_latency.json"))
ours_ms = ours["avg_tpot_ms"]
summary = {"llama_cpp_ms_per_token": llama_ms, "llama_cpp_tokens_per_s": tg["avg_ts"],
           "llama_cpp_build": tg.get("build_commit"), "llama_cpp_cpu": tg.get("cpu_info"),
           "pagedllm_ms_per_token": ours_ms, "pagedllm_ms_per_output_token_incl_prefill": ours["ms_per_output_token"],
           "speedup_vs_llama_cpp": llama_ms / ours_ms}
json.dump(summary, open(f"{out}/llama_cpp_compare.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
EOF
