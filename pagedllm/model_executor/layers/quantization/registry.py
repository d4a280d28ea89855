"""The quantization schemes by name (vLLM's ``register_quantization_config``): each config class registers
the ``--quantization`` names it serves, and a checkpoint's ``quant_method`` is looked up in the same table.

The in-tree schemes register when their modules are imported, which happens on the first look-up: naming
the choices (``QUANTIZATION_METHODS``, for the command line) must not import the kernels behind them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TypeVar

from pagedllm.model_executor.layers.quantization.base import QuantizationConfig

C = TypeVar("C", bound=type[QuantizationConfig])

_CONFIGS: dict[str, type[QuantizationConfig]] = {}
# The modules of the in-tree schemes, imported by ``quantization_configs``.
_SCHEME_MODULES = ("weight_only", "fp8", "gguf", "gptq_awq")


def register_quantization_config(*names: str) -> Callable[[C], C]:
    """Class decorator: ``names`` (``--quantization`` values, or a checkpoint's ``quant_method``) map to the
    class; it builds its config with ``from_flag(name, gguf_file)`` / ``from_hf(cfg)``."""

    def register(cls: C) -> C:
        for name in names:
            if _CONFIGS.get(name, cls) is not cls:
                raise ValueError(f"quantization {name!r} is already registered by {_CONFIGS[name].__name__}")
            _CONFIGS[name] = cls
        return cls

    return register


def quantization_configs() -> Mapping[str, type[QuantizationConfig]]:
    """Every registered scheme by name (the in-tree ones imported first)."""
    for module in _SCHEME_MODULES:
        importlib.import_module(f"{__package__}.{module}")
    return MappingProxyType(_CONFIGS)
