"""Quantization schemes for linear layers: ``--quantization`` name or a checkpoint's config -> a config
whose ``get_linear_method`` gives each ``Linear`` its weight handling (see ``base.py``)."""

from __future__ import annotations

from typing import Any

from pagedllm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from pagedllm.model_executor.layers.quantization.registry import quantization_configs, register_quantization_config

# --quantization choices (vLLM's flag), in the order the help and errors list them; a test holds them equal to
# the registry's names (listed here so that the command line does not import the schemes' kernels). int4
# groups: int4 = 32 inputs per scale, int4-g64, int4-g128. "none": float weights as stored; for a GGUF file,
# dequantized to float (GGUF files default to "gguf").
QUANTIZATION_METHODS = ("none", "int8", "w8a8", "int4", "int4-g64", "int4-g128", "fp8", "gguf", "gptq", "awq")
# The registered schemes a checkpoint's config.json can name (``reads_checkpoints``), likewise.
CHECKPOINT_FORMATS = ("gptq", "awq", "fp8")

__all__ = ["CHECKPOINT_FORMATS", "QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig",
           "default_gguf_quantization", "get_quantization_config", "register_quantization_config"]


def default_gguf_quantization(dtype: str, cuda_available: bool, has_quantized: bool = True) -> tuple[str, str]:
    """(method, reason) for a GGUF file loaded without --quantization: ``gguf`` (blocks kept quantized, the
    CPU kernels' float32 activations) unless the run asks for another dtype or may run on CUDA, where the
    file is dequantized ("none") as before, or the file holds no quantized matrices (``has_quantized``).
    ``dtype``: the requested dtype name (auto, float32, bfloat16, ...)."""
    if not has_quantized:
        return "none", "the file's matrices are float (F32 / F16 / BF16), nothing to keep quantized"
    if dtype not in ("auto", "float32", "fp32"):
        return "none", f"--dtype {dtype} (the kept-quantized kernels take float32 activations)"
    if cuda_available:
        return "none", "CUDA is available (the GPU path dequantizes GGUF files)"
    return "gguf", "the default for GGUF files on the CPU"


def get_quantization_config(method: str | None, hf_config: Any = None,
                            gguf_file: str | None = None) -> QuantizationConfig | None:
    """The config for ``method`` (None: the checkpoint's own ``quantization_config``, if any, else none),
    looked up in the registry (``registry.py``).

    Raises ValueError naming the supported schemes for an unknown method, a checkpoint format pagedllm cannot
    load, or ``gguf`` without a GGUF file.
    """
    configs = quantization_configs()
    hf_quant = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if hf_quant is not None:
        cfg = hf_quant if isinstance(hf_quant, dict) else hf_quant.to_dict()
        fmt = str(cfg.get("quant_method", "")).lower()
        if method not in (None, "", "none", fmt):
            raise ValueError(f"quantization {method!r}: the checkpoint is already quantized with {fmt!r} "
                             "(config.json quantization_config); drop --quantization or pass the same method")
        config_cls = configs.get(fmt)
        if config_cls is None or not config_cls.reads_checkpoints:
            raise ValueError(f"quantization: the checkpoint is quantized with {fmt!r} (config.json "
                             "quantization_config), which pagedllm cannot load; supported checkpoint formats: "
                             f"{', '.join(CHECKPOINT_FORMATS)}; or use a float checkpoint with --quantization "
                             f"{{{', '.join(QUANTIZATION_METHODS)}}}")
        return config_cls.from_hf(cfg)
    if method is None or method in ("", "none"):
        return None
    config_cls = configs.get(method)
    if config_cls is None:
        raise ValueError(f"quantization {method!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)}")
    return config_cls.from_flag(method, gguf_file)
