"""Resolve the ``dtype`` setting to a concrete torch dtype name."""

from __future__ import annotations

import functools

import torch

from pagedllm.config import KV_CACHE_DTYPES
from pagedllm.platforms import platform_for

_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX-512 BF16 or AMX); otherwise bf16 is emulated (slow)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str | None, device: str = "cpu") -> str:
    """"auto" -> "bfloat16" on CUDA or a bf16-capable CPU, else "float32"; aliases -> canonical names."""
    name = (dtype or "auto").lower().replace("torch.", "")
    if name == "auto":
        if device.startswith("cuda") or (device == "auto" and platform_for("cuda").is_available()):
            return "bfloat16"
        return "bfloat16" if cpu_has_fast_bf16() else "float32"
    if name not in _ALIASES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_ALIASES))}")
    return _ALIASES[name]


# The 8-bit caches (vLLM's names): fp8 means e4m3, as vLLM's does on CPUs and CUDA.
_FP8_KV_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_FP8_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def names_fp8_kv_cache(kv_cache_dtype: str | None) -> bool:
    """Whether a ``--kv-cache-dtype`` value asks for an fp8 cache (fp8, fp8_e4m3, fp8_e5m2, any case)."""
    return (kv_cache_dtype or "").lower() in _FP8_KV_DTYPES


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, model_dtype: str) -> str:
    """The KV cache's dtype name: ``model_dtype`` (already resolved) for auto, fp8_e4m3 for fp8, else the one
    asked for (canonical name)."""
    name = (kv_cache_dtype or "auto").lower().replace("torch.", "")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported; use one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    if name in _FP8_KV_DTYPES:
        return _FP8_KV_DTYPES[name]
    return model_dtype if name == "auto" else _ALIASES[name]


def kv_cache_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved ``kv_cache_dtype`` (fp8_e4m3 -> float8_e4m3fn, bfloat16 -> bfloat16 ...)."""
    return _FP8_TORCH_DTYPES.get(name) or torch_dtype(name)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, resolve_dtype(name))
