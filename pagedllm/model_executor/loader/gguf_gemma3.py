"""llama.cpp conventions for Gemma 3: metadata -> ``Gemma3TextConfig``, tensor names -> HF, norm shift.

Facts the mapping rests on (llama.cpp's converter, and transformers' GGUF loader that reads it back):
- Gemma rotates rotate-half ("NeoX") style, so the converter does NOT permute q/k rows (the interleave
  permutation is for the llama architecture only): the rows load as they are.
- The converter stores every norm weight as ``1 + w``; Gemma's norms scale by ``1 + w``, so ``1`` is
  subtracted back here.
- Not in the metadata (llama.cpp hard-codes them too): local rope base 10000, one global layer in six,
  ``query_pre_attn_scalar`` = head dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.model_executor.loader.gguf_archs import LLAMA_LIKE_GLOBAL_NAMES, LLAMA_LIKE_LAYER_NAMES
from pagedllm.model_executor.loader.gguf_file import GGUFFile, gguf_hf_name

# Llama's names, plus the four norms of a Gemma 3 layer (GGUF's "ffn_norm" is the pre-feed-forward one here).
_LAYER_NAMES = {
    **LLAMA_LIKE_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = LLAMA_LIKE_GLOBAL_NAMES


def gemma3_config(gguf: GGUFFile) -> Any:
    from transformers import Gemma3TextConfig

    md = gguf.metadata

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"gemma3.{key}", default)

    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // heads))
    vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or gguf.tensors["token_embd.weight"].shape[1]
    if get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"model: {gguf.path}: GGUF rope scaling on Gemma 3 is not supported yet")
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],
        vocab_size=int(vocab),
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 32768)),
        sliding_window=int(get("attention.sliding_window", 512)),
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e6))},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )


def gemma3_hf_name(gguf_name: str) -> str:
    """``blk.3.post_ffw_norm.weight`` -> ``model.layers.3.post_feedforward_layernorm.weight``."""
    return gguf_hf_name(gguf_name, _LAYER_NAMES, _GLOBAL_NAMES, "Gemma 3")


def iter_gguf_gemma3_weights(gguf: GGUFFile, hf_config: Any,
                             keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor) for every tensor in the file; norms shifted back by -1, q/k as stored.

    ``keep_quantized``: linear-layer matrices (not the embedding) in a quantized block type come as
    ``GGUFQuantTensor`` (raw blocks) for the ``gguf`` quantization instead of float tensors.
    """
    for name in gguf.tensors:
        if keep_quantized and name != "token_embd.weight" and not name.endswith("norm.weight"):
            raw = gguf.load_raw(name)
            if raw is not None:
                yield gemma3_hf_name(name), raw
                continue
        array = gguf.load(name)
        if name.endswith("norm.weight"):
            array = array.astype(np.float32) - 1.0
        elif not array.flags.writeable:
            array = np.array(array, dtype=np.float32)  # F32/F16 tensors are views of the read-only map
        yield gemma3_hf_name(name), torch.from_numpy(array)
