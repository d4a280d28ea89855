"""A random-weight model of an architecture pagedllm has no native code for (it runs through the transformers
fallback), shaped like the default model (SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads), with its
tokenizer: the fallback's throughput against transformers' own generate on a model of the same size.

    python benchmarks/make_fallback_folder.py SRC_FOLDER OUT_DIR [ARCHITECTURE] [bfloat16|float32]

ARCHITECTURE: Olmo2ForCausalLM (default) or another transformers class that takes a Llama-like config.

SRC_FOLDER is an HF folder of the default model (benchmarks/make_hf_folder.py): its sizes and tokenizer are used.
Weights are drawn at std 0.02; the benchmarks ignore EOS, so outputs need not make sense.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
         "pad_token_id", "tie_word_embeddings")


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    arch = sys.argv[3] if len(sys.argv) > 3 else "Olmo2ForCausalLM"
    dtype = getattr(torch, sys.argv[4] if len(sys.argv) > 4 else "bfloat16")
    base = AutoConfig.from_pretrained(src)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{k: getattr(base, k) for k in SIZES if getattr(base, k, None) is not None},
                        architectures=[arch])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.to(dtype).save_pretrained(out)
    for f in src.iterdir():
        if f.name not in ("config.json", "generation_config.json") and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    print(f"wrote {out}: {arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype}")


if __name__ == "__main__":
    main()
