"""Random-weight copy of the default model's architecture (config + tokenizer from prepare.sh), saved as an
HF folder. Weights drawn at std 0.05 so logits are not flat and greedy comparisons mean something.

    python benchmarks/gpu/make_random_model.py CONFIG_DIR OUT_DIR [bfloat16|float32]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaForCausalLM


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
    config = AutoConfig.from_pretrained(src)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.to(dtype).save_pretrained(out)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype})")


if __name__ == "__main__":
    main()
