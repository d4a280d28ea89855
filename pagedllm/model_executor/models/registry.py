"""HF ``architectures`` name -> our model class, with what each supports (for `pagedllm models`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.config import MODEL_IMPLS


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
    ArchitectureInfo("MixtralForCausalLM", "moe", "MixtralForCausalLM", "Mixtral (mixture of experts)", ("hf", "gguf"),
                     "softmax then top-k, renormalised; fused experts", gguf_arch="llama"),
    ArchitectureInfo("Qwen2MoeForCausalLM", "moe", "Qwen2MoeForCausalLM", "Qwen1.5-MoE, Qwen2-MoE", ("hf", "gguf"),
                     "top-k with norm_topk_prob; shared expert with a sigmoid gate",
                     gguf_arch="qwen2moe"),
    ArchitectureInfo("Qwen3MoeForCausalLM", "moe", "Qwen3MoeForCausalLM", "Qwen3-MoE (30B-A3B, 235B-A22B)",
                     ("hf", "gguf"), "top-k with norm_topk_prob; per-head q/k RMSNorm",
                     gguf_arch="qwen3moe"),
    ArchitectureInfo("OlmoeForCausalLM", "moe", "OlmoeForCausalLM", "OLMoE", ("hf",),
                     "q/k RMSNorm over all heads, clip_qkv; softmax then top-k; no tensor parallelism"),
    ArchitectureInfo("GraniteMoeForCausalLM", "moe", "GraniteMoeForCausalLM", "Granite-MoE (granite-3.x-moe)", ("hf",),
                     "embedding / attention / residual / logits multipliers; top-k then softmax; fused experts"),
    ArchitectureInfo("GptOssForCausalLM", "gpt_oss", "GptOssForCausalLM", "gpt-oss (20b, 120b)", ("hf",),
                     "attention sinks; alternating sliding / full layers; expert biases, clamped SwiGLU; "
                     "bf16 / float32 experts (not MXFP4)"),
    ArchitectureInfo("DeepseekV2ForCausalLM", "deepseek", "DeepseekV2ForCausalLM", "DeepSeek-V2, V2-Lite, V2.5",
                     ("hf",), "multi-head latent attention (the latent cached); softmax routing, greedy or "
                     "group-limited; shared experts"),
    ArchitectureInfo("DeepseekV3ForCausalLM", "deepseek", "DeepseekV3ForCausalLM",
                     "DeepSeek-V3 / R1, Kimi K2, Moonlight", ("hf",),
                     "multi-head latent attention (the latent cached); sigmoid routing with score correction and "
                     "group limits; shared experts; multi-token-prediction layers skipped"),
    ArchitectureInfo("Glm4MoeForCausalLM", "glm4_moe", "Glm4MoeForCausalLM", "GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air",
                     ("hf",), "partial rotary (half of each head); q/k/v bias, optional q/k norm; DeepSeek-V3's "
                     "sigmoid routing with score correction; shared experts; multi-token-prediction layer skipped"),
    ArchitectureInfo("MiniMaxM2ForCausalLM", "minimax_m2", "MiniMaxM2ForCausalLM", "MiniMax-M2, M2.1", ("hf",),
                     "q/k norms over all heads, partial rotary; sigmoid routing with score correction, "
                     "renormalised; no tensor parallelism"),
    ArchitectureInfo("Dots1ForCausalLM", "dots1", "Dots1ForCausalLM", "dots.llm1", ("hf",),
                     "Qwen3 attention; DeepSeek-V3's sigmoid routing with score correction; shared experts"),
    ArchitectureInfo("Glm4MoeLiteForCausalLM", "deepseek", "Glm4MoeLiteForCausalLM", "GLM-4.7-Flash", ("hf",),
                     "DeepSeek-V3's latent attention and routing; dense or sparse layers from mlp_layer_types"),
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
    ArchitectureInfo("LlavaNextForConditionalGeneration", "llava_next", "LlavaNextForConditionalGeneration",
                     "LLaVA-NeXT / LLaVA 1.6 (LLaVA over any-resolution grids of tiles)", ("hf",),
                     "the processor's tiles; grid rows unpadded, image_newline after each", inputs=("text", "image")),
    ArchitectureInfo("Idefics3ForConditionalGeneration", "idefics3", "Idefics3ForConditionalGeneration",
                     "Idefics3, SmolVLM (SigLIP tiles + pixel shuffle; SmolLM2 / Llama text)", ("hf",),
                     "image splitting into tiles by the HF processor; encoder cache keyed by image content",
                     inputs=("text", "image")),
    ArchitectureInfo("Gemma3ForConditionalGeneration", "gemma3_mm", "Gemma3ForConditionalGeneration",
                     "Gemma 3 multimodal (4b / 12b / 27b: SigLIP tower + pooling projector; Gemma 3 text)", ("hf",),
                     "each image's 256 tokens attend to each other both ways; no pan-and-scan crops",
                     inputs=("text", "image")),
    ArchitectureInfo("Qwen2VLForConditionalGeneration", "qwen2_vl", "Qwen2VLForConditionalGeneration",
                     "Qwen2-VL (dynamic-resolution ViT with 2D rotary + patch merger; Qwen2 text with M-RoPE)",
                     ("hf",), "images only (no video); per-request 3-axis rotary positions kept by the runner",
                     inputs=("text", "image")),
    ArchitectureInfo("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
                     "Qwen2.5-VL (Qwen2-VL with a windowed-attention ViT: RMSNorm, gated SiLU MLP)", ("hf",),
                     "images only (no video); per-request 3-axis rotary positions kept by the runner",
                     inputs=("text", "image")),
]
_BY_NAME = {a.name: a for a in _ARCHITECTURES}

# Known architectures refused with the reason (instead of the generic "not supported").
_REFUSED: dict[str, str] = {}


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
    for arch in architectures or []:
        if arch in _REFUSED:
            raise ValueError(f"model architecture {arch} is not supported: {_REFUSED[arch]}")
    raise ValueError(f"model architecture {list(architectures or [])} is not supported; "
                     f"supported architectures: {', '.join(supported_architectures())}")


def native_architecture(architectures: list[str]) -> str | None:
    """The first of ``architectures`` pagedllm implements natively, or None."""
    return next((a for a in architectures or [] if a in _BY_NAME), None)


def choose_model_impl(architectures: list[str], model_impl: str, hf_config: Any, *, trust_remote_code: bool = False,
                      hf_folder: bool = True) -> tuple[str, str]:
    """(architecture, implementation) for ``--model-impl``: ``pagedllm`` (native: must exist), ``transformers``
    (the fallback: transformers' class, attention on pagedllm's backends) or ``auto`` (native where it exists, else
    the fallback). ``hf_folder``: the model is an HF safetensors folder (the only thing the fallback loads).
    ValueError naming the architecture and the reason when neither can run it."""
    from pagedllm.model_executor.models.transformers_fallback.support import transformers_model_class

    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl: must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    archs = list(architectures or [])
    native = native_architecture(archs)
    if model_impl == "pagedllm" or (model_impl == "auto" and (native or not hf_folder)):
        get_model_cls(archs)  # raises, naming the supported architectures, when none is native
        return native, "pagedllm"
    if not archs:
        raise ValueError("model: config.json lists no architectures; the transformers fallback needs one")
    if not hf_folder:
        raise ValueError(f"model_impl: the transformers fallback loads Hugging Face safetensors folders only, not "
                         f"this model's format ({archs[0]})")
    try:
        transformers_model_class(hf_config, archs[0], trust_remote_code)
    except ValueError as e:
        native_note = "" if native else "pagedllm has no native implementation of it; "
        raise ValueError(f"{e} ({native_note}native architectures: {', '.join(supported_architectures())})") from None
    return archs[0], "transformers"
