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
    inputs: tuple[str, ...] = ("text",)  # what its prompts may carry: text, image, audio


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
    ArchitectureInfo("WhisperForConditionalGeneration", "whisper", "WhisperForConditionalGeneration",
                     "Whisper (speech to text)", ("hf", "ct2"),
                     "encoder-decoder: audio_features prompts, a cross-attention KV cache group",
                     inputs=("audio", "text")),
    ArchitectureInfo("BertModel", "bert", "BertModel", "BERT encoders (all-MiniLM-L6-v2, ...)", ("hf",),
                     "encoder-only: pooling runner (embeddings)"),
    ArchitectureInfo("LlavaForConditionalGeneration", "llava", "LlavaForConditionalGeneration",
                     "LLaVA 1.5 (CLIP vision tower + projector; Llama / Mistral / Qwen2 text)", ("hf",),
                     "images expanded to placeholder tokens; encoder cache keyed by image content",
                     inputs=("text", "image")),
    ArchitectureInfo("Idefics3ForConditionalGeneration", "idefics3", "Idefics3ForConditionalGeneration",
                     "Idefics3, SmolVLM (SigLIP tiles + pixel shuffle; SmolLM2 / Llama text)", ("hf",),
                     "image splitting into tiles by the HF processor; encoder cache keyed by image content",
                     inputs=("text", "image")),
]
_BY_NAME = {a.name: a for a in _ARCHITECTURES}


def supported_architectures() -> list[str]:
    return sorted(_BY_NAME)


def architecture_formats() -> dict[str, list[str]]:
    """HF architecture name -> the formats it loads from ("hf", "gguf")."""
    return {a.name: list(a.formats) for a in _ARCHITECTURES}


def architecture_infos() -> list[ArchitectureInfo]:
    return list(_ARCHITECTURES)


def architecture_inputs(name: str) -> tuple[str, ...]:
    """The inputs an architecture's prompts may carry (("text",) for an unknown one)."""
    info = _BY_NAME.get(name)
    return info.inputs if info is not None else ("text",)


def get_model_cls(architectures: list[str]) -> type:
    """First supported class among ``architectures`` (as in a config.json); ValueError if none."""
    import importlib

    for arch in architectures or []:
        info = _BY_NAME.get(arch)
        if info is not None:
            module = importlib.import_module(f"pagedllm.model_executor.models.{info.module}")
            return getattr(module, info.class_name)
    raise ValueError(f"model architecture {list(architectures or [])} is not supported; "
                     f"supported architectures: {', '.join(supported_architectures())}")
