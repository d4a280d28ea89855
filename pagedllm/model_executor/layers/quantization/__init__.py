"""Quantization schemes for linear layers: ``--quantization`` name or a checkpoint's config -> a config
whose ``get_linear_method`` gives each ``Linear`` its weight handling (see ``base.py``)."""

from __future__ import annotations

from typing import Any

from pagedllm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig

# --quantization choices (vLLM's flag). int4 groups: int4 = 32 inputs per scale, int4-g64, int4-g128.
# "none": float weights as stored; for a GGUF file, dequantized to float (GGUF files default to "gguf").
QUANTIZATION_METHODS = ("none", "int8", "w8a8", "int4", "int4-g64", "int4-g128", "fp8", "gguf", "gptq", "awq")

__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "default_gguf_quantization",
           "get_quantization_config"]


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
    """The config for ``method`` (None: the checkpoint's own ``quantization_config``, if any, else none).

    Raises ValueError naming the supported schemes for an unknown method, a checkpoint format pagedllm cannot
    load, or ``gguf`` without a GGUF file.
    """
    hf_quant = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if hf_quant is not None:
        cfg = hf_quant if isinstance(hf_quant, dict) else hf_quant.to_dict()
        fmt = str(cfg.get("quant_method", "")).lower()
        if method not in (None, "", "none", fmt):
            raise ValueError(f"quantization {method!r}: the checkpoint is already quantized with {fmt!r} "
                             "(config.json quantization_config); drop --quantization or pass the same method")
        if fmt == "gptq":
            from pagedllm.model_executor.layers.quantization.gptq_awq import GPTQConfig

            return GPTQConfig.from_hf(cfg)
        if fmt == "awq":
            from pagedllm.model_executor.layers.quantization.gptq_awq import AWQConfig

            return AWQConfig.from_hf(cfg)
        if fmt == "fp8":
            from pagedllm.model_executor.layers.quantization.fp8 import Fp8Config

            return Fp8Config.from_hf(cfg)
        raise ValueError(f"quantization: the checkpoint is quantized with {fmt!r} (config.json "
                         "quantization_config), which pagedllm cannot load; supported checkpoint formats: gptq, awq, "
                         f"fp8; or use a float checkpoint with --quantization {{{', '.join(QUANTIZATION_METHODS)}}}")
    if method is None or method in ("", "none"):
        return None
    if method == "int8":
        from pagedllm.model_executor.layers.quantization.weight_only import Int8Config

        return Int8Config()
    if method == "w8a8":
        from pagedllm.model_executor.layers.quantization.weight_only import W8A8Config

        return W8A8Config()
    if method.startswith("int4") and method in QUANTIZATION_METHODS:
        from pagedllm.model_executor.layers.quantization.weight_only import Int4Config

        return Int4Config(int(method.removeprefix("int4-g") or 32) if "-g" in method else 32)
    if method == "fp8":
        from pagedllm.model_executor.layers.quantization.fp8 import Fp8Config

        return Fp8Config()
    if method in ("gptq", "awq"):
        raise ValueError(f"quantization {method!r} reads checkpoints whose config.json has a "
                         "quantization_config of that method; this model has none")
    if method == "gguf":
        if not gguf_file:
            raise ValueError("quantization 'gguf' needs a .gguf model file")
        from pagedllm.model_executor.layers.quantization.gguf import GGUFConfig

        return GGUFConfig()
    raise ValueError(f"quantization {method!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)}")
