"""``resolve_model_config``: fill a ModelConfig from the model's own files (local only, no network)."""

from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.logger import init_logger
from pagedllm.model_executor.loader.dtype import resolve_dtype
from pagedllm.model_executor.loader.model_source import find_model_source
from pagedllm.platforms import platform_for

logger = init_logger(__name__)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _eos_ids(folder: str, hf_config: Any, gguf_metadata: dict[str, Any] | None) -> list[int]:
    """EOS ids: generation_config.json first (it lists all stop ids), then the config/GGUF metadata."""
    gen_path = os.path.join(folder, "generation_config.json")
    if gguf_metadata is None and os.path.isfile(gen_path):
        with open(gen_path) as f:
            ids = _as_id_list(json.load(f).get("eos_token_id"))
        if ids:
            return ids
    ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    if gguf_metadata is not None:
        # llama.cpp also records end-of-turn / end-of-message tokens (Llama 3 chat stops on them).
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if gguf_metadata.get(key) is not None and int(gguf_metadata[key]) not in ids:
                ids.append(int(gguf_metadata[key]))
    return ids


def _load_hf_config(folder: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
        if trust_remote_code:
            from pagedllm.model_executor.models.transformers_fallback.support import make_remote_config_picklable

            make_remote_config_picklable(config)  # engine processes unpickle it
        return config
    except (ValueError, KeyError) as e:
        # Unknown model_type (or modeling code not trusted): say which architecture and why neither path runs it.
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
        archs = raw.get("architectures") or []
        from pagedllm.model_executor.models.registry import native_architecture, supported_architectures
        from pagedllm.model_executor.models.transformers_fallback.support import unreadable_config_error

        if not native_architecture(archs):
            error = unreadable_config_error(archs, raw.get("model_type"), bool(raw.get("auto_map")),
                                            trust_remote_code, e)
            raise ValueError(f"{error} (pagedllm has no native implementation of it; native architectures: "
                             f"{', '.join(supported_architectures())})") from e
        raise ValueError(f"model: cannot read {folder}/config.json: {e}") from e


def resolve_model_config(mc: ModelConfig) -> ModelConfig:
    """Locate ``mc.model`` and fill ``model_path``, ``gguf_file``, ``hf_config``, ``architecture``,
    ``vocab_size``, ``eos_token_ids``, ``max_model_len`` and a concrete ``dtype``. Returns ``mc``.

    Raises ValueError for a missing model, an unsupported architecture or a too-long ``max_model_len``.
    """
    from pagedllm.model_executor.models.registry import choose_model_impl

    source = find_model_source(mc.model)
    gguf_metadata = None
    gguf_quantized = False  # whether the GGUF file stores any matrix in a quantized block type
    if source.gguf_file:
        from pagedllm.model_executor.loader.gguf_file import GGUFFile
        from pagedllm.model_executor.loader.gguf_llama import gguf_to_hf_config

        gguf = GGUFFile(source.gguf_file)
        gguf_metadata = gguf.metadata
        gguf_quantized = gguf.has_quantized_matrices()
        hf_config = gguf_to_hf_config(gguf)
        mc.model_path = source.gguf_file
        mc.gguf_file = source.gguf_file
    elif source.ct2_file:
        from pagedllm.model_executor.loader.ct2_whisper import ct2_whisper_config

        hf_config = ct2_whisper_config(source.folder)
        mc.model_path = source.folder
        mc.gguf_file = None
        mc.ct2_file = source.ct2_file
    else:
        hf_config = _load_hf_config(source.folder, mc.trust_remote_code)
        mc.model_path = source.folder
        mc.gguf_file = None
        mc.ct2_file = None
    archs = list(getattr(hf_config, "architectures", None) or [])
    # Fails early, naming the architecture and why neither the native code nor the fallback runs it.
    mc.architecture, mc.model_impl = choose_model_impl(archs, mc.model_impl, hf_config,
                                                       trust_remote_code=mc.trust_remote_code,
                                                       hf_folder=not (mc.gguf_file or mc.ct2_file))
    if mc.model_impl == "transformers":
        from pagedllm.model_executor.models.transformers_fallback.support import check_fallback_settings

        check_fallback_settings(mc.architecture, mc.quantization, hf_config)
    mc.hf_config = hf_config
    # A vision-language model's vocabulary, length and stop ids are its text model's.
    text_config = hf_config.text_config if hasattr(hf_config, "vision_config") else hf_config
    mc.vocab_size = int(text_config.vocab_size)
    mc.eos_token_ids = _eos_ids(source.folder, text_config, gguf_metadata)
    from pagedllm.model_executor.layers.quantization import default_gguf_quantization, get_quantization_config

    # The defaults follow the device the model runs on, not whether this host has a GPU (--device cpu on one).
    on_cuda = mc.device == "cuda" or (mc.device == "auto" and platform_for("cuda").is_available())
    if mc.gguf_file and mc.quantization is None:
        mc.quantization, why = default_gguf_quantization(str(mc.dtype).lower(), on_cuda,
                                                         gguf_quantized)
        logger.info("GGUF file: %s (--quantization %s: %s; %s)", "blocks kept quantized" if mc.quantization == "gguf"
                    else "dequantized to float", mc.quantization, why,
                    "--quantization none dequantizes them" if mc.quantization == "gguf"
                    else "--quantization gguf keeps them quantized on the CPU")

    # Fails early with a clear message (unknown method, checkpoint format we cannot read, gguf without GGUF).
    if get_quantization_config(mc.quantization, hf_config, mc.gguf_file) is not None and mc.dtype == "auto":
        if not on_cuda:
            mc.dtype = "float32"  # the CPU's quantized kernels take float32 activations (CUDA's: bf16 too)
    mc.dtype = resolve_dtype(mc.dtype, "cuda" if on_cuda else "cpu")
    st_max_len = _resolve_runner(mc, None if mc.gguf_file else source.folder)

    model_max = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    if mc.is_encoder_decoder:
        from pagedllm.model_executor.loader.whisper_config import finish_whisper_config

        model_max = finish_whisper_config(mc, source.folder)
    if st_max_len and (model_max == 0 or st_max_len < model_max):
        model_max = st_max_len  # the length a sentence-transformers model was trained for (and truncates at)
    if mc.max_model_len is None:
        mc.max_model_len = model_max
    elif model_max and mc.max_model_len > model_max:
        raise ValueError(f"max_model_len: {mc.max_model_len} is longer than the model's maximum context "
                         f"({model_max} tokens)")
    return mc


def _resolve_runner(mc: ModelConfig, folder: str | None) -> int | None:
    """Fill ``runner``, ``is_encoder_only`` and (pooling) ``pooler_config``; returns the sentence-transformers
    maximum input length of a pooling model, if its folder names one."""
    from pagedllm.model_executor.loader.pooling_config import (
        resolve_pooler_config,
        resolve_runner,
        sentence_transformers_max_len,
    )
    from pagedllm.model_executor.models.registry import get_model_cls

    if mc.model_impl == "transformers":  # a causal decoder, or an encoder (pooling only) of transformers'
        from pagedllm.model_executor.models.transformers_fallback.support import is_fallback_encoder

        mc.is_encoder_only = is_fallback_encoder(mc.hf_config, mc.architecture)
        mc.is_encoder_decoder = False
        mc.is_multimodal = False
        default_pooling_type = "CLS" if mc.is_encoder_only else "LAST"
    else:
        model_cls = get_model_cls([mc.architecture])
        mc.is_encoder_only = bool(getattr(model_cls, "is_encoder_only", False))
        mc.is_encoder_decoder = bool(getattr(model_cls, "is_encoder_decoder", False))
        mc.is_multimodal = bool(getattr(model_cls, "supports_multimodal", False))
        mc.image_tokens_attend_bidirectionally = bool(getattr(model_cls, "image_tokens_attend_bidirectionally",
                                                              False))
        default_pooling_type = getattr(model_cls, "default_pooling_type", "LAST")
    mc.runner = resolve_runner(mc.runner, mc.is_encoder_only, folder, mc.architecture)
    if not mc.is_pooling:
        return None
    mc.pooler_config = resolve_pooler_config(folder, mc.hf_config, default_pooling_type, mc.pooler_config)
    logger.info("pooling runner: %s pooling%s", mc.pooler_config.pooling_type,
                ", normalized" if mc.pooler_config.normalize else "")
    return sentence_transformers_max_len(folder)
