"""llama.cpp conventions for the llama architecture: metadata -> transformers config, tensor names -> HF.

Mistral and other Llama-shaped models are stored under the same ``llama`` architecture in GGUF.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.model_executor.loader.gguf_file import GGUFFile, gguf_hf_name, iter_expert_tensors

# GGUF ``general.architecture`` -> HF ``architectures`` entry (unsupported ones still get a name so the
# registry can say what is supported).
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
               "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Mixtral (the llama architecture with ``llama.expert_count``): the router (kept float) and each layer's experts,
# one [E, rows, cols] tensor per projection, handed over per expert as an HF checkpoint stores them.
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
              "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
_PER_EXPERT = (".ffn_gate_exps.", ".ffn_up_exps.", ".ffn_down_exps.")


def supported_gguf_architectures() -> list[str]:
    """GGUF ``general.architecture`` values we load."""
    from pagedllm.model_executor.loader.gguf_archs import GGUF_ARCHS

    return sorted({"llama", "gemma3", *GGUF_ARCHS})


def gguf_architecture(gguf: GGUFFile) -> str:
    arch = gguf.metadata.get("general.architecture", "")
    return _GGUF_ARCHS.get(arch, f"{arch} (GGUF)")


def gguf_to_hf_config(gguf: GGUFFile) -> Any:
    """A transformers config built from the file's metadata (no tensor data is read): ``LlamaConfig`` for
    the llama architecture, ``Gemma3TextConfig`` for gemma3."""
    from transformers import LlamaConfig

    from pagedllm.model_executor.loader.gguf_archs import GGUF_ARCHS

    md = gguf.metadata
    arch = md.get("general.architecture", "")
    hf_arch = gguf_architecture(gguf)
    if hf_arch == "Gemma3ForCausalLM":
        from pagedllm.model_executor.loader.gguf_gemma3 import gemma3_config

        return gemma3_config(gguf)
    if arch in GGUF_ARCHS:
        return GGUF_ARCHS[arch].config(gguf)
    if hf_arch not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"model: {gguf.path}: GGUF architecture {arch!r} is not supported; supported GGUF "
                         f"architectures: {', '.join(supported_gguf_architectures())}")
    # llama.cpp stores Llama 3.1's rope scaling as a per-frequency divisor tensor, not as metadata: it goes
    # to the config as ``rope_freq_factors`` (rope_parameters stay "default"), read by ``rope_settings``.
    freq_factors = (gguf.load("rope_freqs.weight").astype(np.float64).tolist()
                    if "rope_freqs.weight" in gguf.tensors else None)

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = (get("vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
             or gguf.tensors["token_embd.weight"].shape[1])
    from pagedllm.model_executor.loader.gguf_archs import gguf_rope_parameters

    rope = gguf_rope_parameters(gguf)  # none, linear or yarn
    # Mistral-style files may record their sliding window (llama.cpp's llama converter does not, but others do).
    window = int(get("attention.sliding_window", 0) or 0)
    config_cls, experts = LlamaConfig, {}
    if window:
        from transformers import MistralConfig

        hf_arch, config_cls = "MistralForCausalLM", MistralConfig
    if get("expert_count"):
        from transformers import MixtralConfig

        if "blk.0.ffn_gate_exps.weight" not in gguf.tensors:
            raise ValueError(f"model: {gguf.path}: a llama-architecture MoE GGUF without ffn_gate_exps tensors (an "
                             "older per-expert layout) is not supported; convert it again with llama.cpp")
        hf_arch, config_cls = "MixtralForCausalLM", MixtralConfig
        experts = dict(num_local_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")))
    return config_cls(
        **experts,
        architectures=[hf_arch],
        sliding_window=window or None,
        rope_freq_factors=freq_factors,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 2048)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        mlp_bias="blk.0.ffn_up.bias" in gguf.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    return gguf_hf_name(gguf_name, {**_LAYER_NAMES, **_MOE_NAMES}, _GLOBAL_NAMES, "Llama")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row permutation (rotary pairs interleaved -> rotate-half halves).

    Rows per head go from (head_dim/2, 2) order back to (2, head_dim/2). Works for weights and biases.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(gguf: GGUFFile, hf_config: Any, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) for every tensor of a GGUF file of any supported architecture; ``keep_quantized``
    (the ``gguf`` quantization) keeps linear-layer matrices as raw blocks."""
    from pagedllm.model_executor.loader.gguf_archs import GGUF_ARCHS, iter_gguf_arch_weights

    arch = gguf.metadata.get("general.architecture", "")
    if arch in GGUF_ARCHS:
        return iter_gguf_arch_weights(gguf, GGUF_ARCHS[arch], hf_config, keep_quantized)
    if gguf_architecture(gguf) == "Gemma3ForCausalLM":
        from pagedllm.model_executor.loader.gguf_gemma3 import iter_gguf_gemma3_weights

        return iter_gguf_gemma3_weights(gguf, hf_config, keep_quantized)
    return iter_gguf_llama_weights(gguf, hf_config, keep_quantized)


def iter_gguf_llama_weights(gguf: GGUFFile, hf_config: Any,
                            keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor) for every tensor in the file, in file order; q/k rows un-permuted (the
    llama converter interleaves rotary pairs; other architectures' converters do not).

    ``keep_quantized``: linear-layer matrices (not the embedding) whose blocks the ``gguf`` quantization
    reads come as ``GGUFQuantTensor`` (raw blocks) instead of float tensors.
    """
    n_heads = hf_config.num_attention_heads
    n_kv = hf_config.num_key_value_heads
    for name in gguf.tensors:
        if name == "rope_freqs.weight":
            continue  # read into the config (rope_freq_factors)
        if any(part in name for part in _PER_EXPERT):
            yield from iter_expert_tensors(gguf, name, hf_name(name), keep_quantized)
            continue
        if keep_quantized and name != "token_embd.weight" and ".ffn_gate_inp." not in name:
            raw = gguf.load_raw(name)
            if raw is not None:
                if ".attn_q." in name:
                    raw.raw = torch.from_numpy(_unpermute(raw.raw.numpy(), n_heads))
                elif ".attn_k." in name:
                    raw.raw = torch.from_numpy(_unpermute(raw.raw.numpy(), n_kv))
                yield hf_name(name), raw
                continue
        array = gguf.load(name)
        if ".attn_q." in name:
            array = _unpermute(array, n_heads)
        elif ".attn_k." in name:
            array = _unpermute(array, n_kv)
        if not array.flags.writeable:
            array = np.array(array, dtype=np.float32)  # F32/F16 tensors are views of the read-only map
        yield hf_name(name), torch.from_numpy(array)
