"""Write a transformers model as a GGUF file the way llama.cpp's converter lays it out, for the GGUF tests.

Written from the published format: tensor names come from the ``gguf`` package's own name map
(``gguf.get_tensor_name_map``), metadata keys from its ``GGUFWriter``; the per-architecture layout changes
are the converter's: q/k rows permuted (rotary pairs interleaved) for the llama architecture only, GPT-2's
Conv1D weights transposed to [out, in] and its tied head written out as ``output``, Phi-3's LongRoPE factors
stored as tensors. Matrices can be stored F32 or Q8_0 (``quantize_roundtrip`` gives the reference model the
same Q8_0 values).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

# transformers ``architectures`` -> GGUF architecture name
GGUF_ARCH_OF = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "GPT2LMHeadModel": "gpt2",
                "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama"}
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_SKIP = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Matrices and MoE expert stacks; the converter keeps norms and the MoE router (``ffn_gate_inp``) in F32."""
    router = "ffn_gate_inp" in name or ".mlp.gate." in name or ".shared_expert_gate." in name
    return len(shape) in (2, 3) and shape[-1] % 32 == 0 and "norm" not in name and not router


def _torch_layout(name: str, tensor: torch.Tensor, arch: str) -> torch.Tensor:
    """The checkpoint tensor as [out, in] (GPT-2 stores its Conv1D weights [in, out])."""
    return tensor.t() if arch == "gpt2" and name.endswith(_CONV1D) else tensor


def quantize_roundtrip(model: Any) -> None:
    """Replace every matrix the writer stores as Q8_0 by its Q8_0 round trip, in place."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    arch = GGUF_ARCH_OF[model.config.architectures[0]]
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = _torch_layout(name, p.data, arch)
            if _quantizable(name, tuple(w.shape)):
                q = quantize(w.float().contiguous().numpy(), GGMLQuantizationType.Q8_0)
                back = torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0).reshape(w.shape))
                p.data.copy_(_torch_layout(name, back, arch))


def _interleave_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows per head from rotate-half order (two halves) to interleaved pairs, as the llama converter does."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _byte_vocab(size: int) -> list[str]:
    """Byte-level BPE tokens (GPT-2's byte-to-unicode spelling): token i is byte i, except the last, which is
    the merge of "a" and "b" (see ``MERGES``)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(size - 1)] + ["ab"]


MERGES = ["a b"]


def _metadata(writer: Any, cfg: Any, arch: str) -> None:
    import gguf

    if arch == "gpt2":
        writer.add_context_length(cfg.n_positions)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        writer.add_block_count(cfg.n_layer)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if head_dim != cfg.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                             or cfg.original_max_position_embeddings)
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            import math

            scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "llama" and getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)  # what a Mistral-style file records
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "llama" and getattr(cfg, "num_local_experts", None):  # Mixtral
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)


def write_gguf(model: Any, path: str | os.PathLike, quantized: bool = False, arch: str | None = None) -> str:
    """Write ``model`` (a transformers causal LM) to ``path`` as GGUF; Q8_0 matrices when ``quantized``."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    cfg = model.config
    arch = arch or GGUF_ARCH_OF[cfg.architectures[0]]
    n_layers = cfg.n_layer if arch == "gpt2" else cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    _metadata(writer, cfg, arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_byte_vocab(cfg.vocab_size))
    writer.add_token_types([1] * cfg.vocab_size)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)

    tensors: list[tuple[str, torch.Tensor]] = []
    for name, t in model.state_dict().items():
        if any(s in name for s in _SKIP):
            continue
        if name == "lm_head.weight" and arch != "gpt2" and getattr(cfg, "tie_word_embeddings", False):
            continue  # llama.cpp writes no output.weight for a tied head (GPT-2's converter does)
        if name.endswith(".mlp.experts.gate_up_proj"):  # transformers' in-memory [E, 2I, H]: the file splits it
            gate, up = t.detach().float().chunk(2, dim=1)
            prefix = name.removesuffix("gate_up_proj")
            tensors += [(f"{names.get_name(prefix + 'gate_proj')}.weight", gate),
                        (f"{names.get_name(prefix + 'up_proj')}.weight", up)]
            continue
        if name.endswith(".mlp.experts.down_proj"):
            tensors.append((f"{names.get_name(name)}.weight", t.detach().float()))
            continue
        base, _, kind = name.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None:
            raise KeyError(f"no GGUF name for {name}")
        t = _torch_layout(name, t.detach().float(), arch)
        if arch == "llama" and gguf_base.endswith((".attn_q", ".attn_k")):
            heads = cfg.num_attention_heads if gguf_base.endswith(".attn_q") else cfg.num_key_value_heads
            t = _interleave_rotary_rows(t, heads)
        tensors.append((f"{gguf_base}.{kind}", t))
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        tensors.append(("rope_factors_long.weight", torch.tensor(rope["long_factor"])))
        tensors.append(("rope_factors_short.weight", torch.tensor(rope["short_factor"])))
    if arch == "llama" and rope.get("rope_type") == "llama3":
        # Llama 3.1: the converter stores a divisor per frequency (default / scaled), not the rope parameters.
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        default = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        tensors.append(("rope_freqs.weight", (default / model.model.rotary_emb.inv_freq.double()).float()))
    for gguf_name, t in tensors:
        array = t.contiguous().numpy().astype(np.float32)
        if quantized and _quantizable(gguf_name, array.shape):
            writer.add_tensor(gguf_name, quantize(array, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
