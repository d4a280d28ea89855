#!/usr/bin/env bash
# Speech to text side by side on one quiet machine, 2 threads, float32 (or DTYPE), the same 16 espeak-ng clips (5-10 s)
# and the same CTranslate2 weights (whisper-base): pagedllm (`pagedllm bench transcription`, sequential and concurrent),
# faster-whisper float32 and int8 (its own venv, WhisperModel one clip at a time and BatchedInferencePipeline), and
# transformers (generate one clip at a time, ASR pipeline batched). Transcripts are held against transformers'.
#   benchmarks/whisper_compare.sh
#   MODEL=whisper-tiny.en FW_VENV=/path/to/venv benchmarks/whisper_compare.sh
#   DTYPE=bfloat16 benchmarks/whisper_compare.sh     # pagedllm and transformers in bf16 (faster-whisper has none on CPU)
# faster-whisper is never a dependency: FW_VENV is made here with `pip install faster-whisper` when missing.
# Results: $OUT/whisper_{pagedllm,fw_float32,fw_int8,transformers}.json and $OUT/whisper_compare.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-whisper-base}
DTYPE=${DTYPE:-float32}
FW_VENV=${FW_VENV:-$HOME/.cache/pagedllm-peers/faster-whisper-venv}
CLIPS=$OUT/speech_clips
mkdir -p "$OUT"
grep -m1 "model name" /proc/cpuinfo
echo "flags: $(grep -m1 -o -w -E "avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile" /proc/cpuinfo | sort -u | tr "\n" " ")"
if [ ! -x "$FW_VENV/bin/python" ]; then
  python3 -m venv "$FW_VENV" && "$FW_VENV/bin/pip" install -q faster-whisper
fi
FOLDER=$($PY -c "from pagedllm.model_executor.loader.packaged_models import ct2_folder as f; print(f('$MODEL'))")

$PY -m pagedllm bench transcription --model "$MODEL" --dtype "$DTYPE" --clips-dir "$CLIPS" \
  --output-json "$OUT/whisper_pagedllm.json"
"$FW_VENV/bin/python" benchmarks/whisper_peers.py faster-whisper "$FOLDER" "$OUT/whisper_fw_float32.json" "$CLIPS"/*.wav
"$FW_VENV/bin/python" benchmarks/whisper_peers.py faster-whisper "$FOLDER" "$OUT/whisper_fw_int8.json" "$CLIPS"/*.wav \
  --compute-type int8
$PY benchmarks/whisper_peers.py transformers "$FOLDER" "$OUT/whisper_transformers.json" "$CLIPS"/*.wav \
  --compute-type "$DTYPE"

$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
runs = {k: json.load(open(f"{out}/whisper_{k}.json")) for k in ("pagedllm", "fw_float32", "fw_int8", "transformers")}
ref = runs["transformers"]["sequential"]["texts"]
summary = {}
for name, r in runs.items():
    for mode in ("sequential", "concurrent"):
        texts = r[mode]["texts"]
        summary[f"{name}_{mode}"] = {"clips_per_s": round(r[mode]["clips_per_s"], 3),
                                     "real_time_factor": round(r[mode]["real_time_factor"], 4),
                                     "equal_to_transformers": sum(a == b for a, b in zip(texts, ref))}
peers = max(v["clips_per_s"] for k, v in summary.items() if not k.startswith("pagedllm"))
summary["pagedllm_concurrent_vs_best_peer"] = round(summary["pagedllm_concurrent"]["clips_per_s"] / peers, 3)
summary["num_clips"], summary["audio_seconds"] = len(ref), runs["pagedllm"]["audio_seconds"]
json.dump(summary, open(f"{out}/whisper_compare.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PYEOF
