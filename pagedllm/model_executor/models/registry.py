"""HF ``architectures`` name -> our model class, with what each supports (for `pagedllm models`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureInfo:
    name: str  # as in config.json's "architectures"
    module: str  # under pagedllm.model_executor.models
    class_name: str
    family: str
    formats: tuple[str, ...]  # "hf" (safetensors folder), "gguf", "ct2" (a CTranslate2 folder)
    notes: str = ""
    gguf_arch: str = ""  # the GGUF file's general.architecture, where "gguf" is a format


_ARCHITECTURES = [
    ArchitectureInfo("LlamaForCausalLM", "llama", "LlamaForCausalLM", "Llama 2/3, SmolLM2, TinyLlama",
                     ("hf", "gguf"), "llama3 / yarn / linear rope scaling", gguf_arch="llama"),
    ArchitectureInfo("MistralForCausalLM", "llama", "LlamaForCausalLM", "Mistral", ("hf", "gguf"),
                     "sliding-window attention; KV blocks outside the window are freed", gguf_arch="llama"),
    ArchitectureInfo("Qwen2ForCausalLM", "llama", "Qwen2ForCausalLM", "Qwen2, Qwen2.5", ("hf", "gguf"),
                     "q/k/v bias; yarn rope scaling", gguf_arch="qwen2"),
    ArchitectureInfo("Qwen3ForCausalLM", "llama", "Qwen3ForCausalLM", "Qwen3 (dense)", ("hf", "gguf"),
                     "per-head q/k RMSNorm", gguf_arch="qwen3"),
    ArchitectureInfo("Phi3ForCausalLM", "llama", "Phi3ForCausalLM", "Phi-3, Phi-3.5", ("hf", "gguf"),
                     "fused qkv / gate_up checkpoint; longrope (su) rope scaling", gguf_arch="phi3"),
    ArchitectureInfo("Gemma3ForCausalLM", "gemma3", "Gemma3ForCausalLM", "Gemma 3 (text)", ("hf", "gguf"),
                     "5 local : 1 global layers, sliding window", gguf_arch="gemma3"),
    ArchitectureInfo("GPT2LMHeadModel", "gpt2", "GPT2LMHeadModel", "GPT-2", ("hf", "gguf"),
                     "learned positions, Conv1D weights", gguf_arch="gpt2"),
    ArchitectureInfo("MixtralForCausalLM", "moe", "MixtralForCausalLM", "Mixtral (mixture of experts)", ("hf", "gguf"),
                     "softmax then top-k, renormalised; fused experts", gguf_arch="llama"),
    ArchitectureInfo("Qwen2MoeForCausalLM", "moe", "Qwen2MoeForCausalLM", "Qwen1.5-MoE, Qwen2-MoE", ("hf", "gguf"),
                     "top-k with norm_topk_prob; shared expert with a sigmoid gate",
                     gguf_arch="qwen2moe"),
    ArchitectureInfo("Qwen3MoeForCausalLM", "moe", "Qwen3MoeForCausalLM", "Qwen3-MoE (30B-A3B, 235B-A22B)",
                     ("hf", "gguf"), "top-k with norm_topk_prob; per-head q/k RMSNorm",
                     gguf_arch="qwen3moe"),
    ArchitectureInfo("WhisperForConditionalGeneration", "whisper", "WhisperForConditionalGeneration",
                     "Whisper (speech to text)", ("hf", "ct2"),
                     "encoder-decoder: audio_features prompts, a cross-attention KV cache group"),
    ArchitectureInfo("BertModel", "bert", "BertModel", "BERT encoders (all-MiniLM-L6-v2, ...)", ("hf",),
                     "encoder-only: pooling runner (embeddings)"),
]
_BY_NAME = {a.name: a for a in _ARCHITECTURES}

# Known architectures refused with the reason (instead of the generic "not supported").
_REFUSED = {
    "GptOssForCausalLM": "gpt-oss needs attention sinks, which pagedllm's attention backends do not implement",
    "OlmoeForCausalLM": "OLMoE's q/k RMSNorm over all heads together is not implemented",
    "GraniteMoeForCausalLM": "Granite-MoE's embedding/residual/logit multipliers are not implemented",
    "DeepseekV2ForCausalLM": "DeepSeek's multi-head latent attention and grouped routing are not implemented",
    "DeepseekV3ForCausalLM": "DeepSeek's multi-head latent attention and grouped routing are not implemented",
}


def supported_architectures() -> list[str]:
    return sorted(_BY_NAME)


def architecture_formats() -> dict[str, list[str]]:
    """HF architecture name -> the formats it loads from ("hf", "gguf")."""
    return {a.name: list(a.formats) for a in _ARCHITECTURES}


def architecture_infos() -> list[ArchitectureInfo]:
    return list(_ARCHITECTURES)


def get_model_cls(architectures: list[str]) -> type:
    """First supported class among ``architectures`` (as in a config.json); ValueError if none."""
    import importlib

    for arch in architectures or []:
        info = _BY_NAME.get(arch)
        if info is not None:
            module = importlib.import_module(f"pagedllm.model_executor.models.{info.module}")
            return getattr(module, info.class_name)
    for arch in architectures or []:
        if arch in _REFUSED:
            raise ValueError(f"model architecture {arch} is not supported: {_REFUSED[arch]}")
    raise ValueError(f"model architecture {list(architectures or [])} is not supported; "
                     f"supported architectures: {', '.join(supported_architectures())}")
