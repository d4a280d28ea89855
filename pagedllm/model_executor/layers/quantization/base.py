"""The layer-owned weight seam: a ``QuantizationConfig`` hands each linear layer a ``LinearMethod`` that
creates its parameters, loads checkpoint shards into them and repacks them once loading is done.

Loader contract: every parameter that needs special loading carries
``param.weight_loader(param, loaded_weight, shard_id=None)``; ``shard_id`` is the index of the shard in a
fused layer (q, k, v = 0, 1, 2; gate, up = 0, 1), None for an unfused one. ``load_model`` then calls
``process_weights_after_loading()`` on every module that has it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from pagedllm.platforms import platform_for

if TYPE_CHECKING:
    from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight


class LinearMethod:
    """How one ``Linear`` stores and multiplies its weight. Subclasses implement a scheme.

    After ``process_weights_after_loading`` the layer's weight is one ``BoundWeight`` (``bound_weight.py``) that
    the method keeps on the layer and hands out through ``bound_weight``; multiplying, fusing an activation,
    the C++ kernel of a step graph and the bytes held are that object's.
    """

    #: Scheme name used in logs ("unquantized", "int8", "int4", "gguf:Q4_1", ...).
    name = "unquantized"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Register the layer's weight parameters (on the current default device), each with a weight_loader."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack the loaded weights into the kernel's layout (may replace or drop parameters)."""

    def bound_weight(self, layer: nn.Module) -> BoundWeight | None:
        """The layer's weight as bound for its kernel, or None before ``process_weights_after_loading``."""
        return None

    def set_bound_weight(self, layer: nn.Module, weight: BoundWeight) -> None:
        """Make ``weight`` (the same weight, another kernel choice: ``kernel_choice.py``) the layer's. Only
        ``Linear.bind_weight`` calls it, which also rebinds the layer's call."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> [M, N] (+ bias). ``out``: optional [M, N] float32 destination, returned when used."""
        return self.bound_weight(layer).matmul(x, bias, out)

    def scheme(self, layer: nn.Module) -> str:
        """Name for the memory report (a GGUF layer names its block type)."""
        return self.name

    def apply_activation(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor | None:
        """activation(x [M, K] @ W^T + bias) in one fused call ("gelu", "gelu_tanh", "relu"), or None where the
        weight has no fused form (the caller then applies the activation itself)."""
        weight = self.bound_weight(layer)
        return weight.matmul_activation(x, bias, activation) if weight is not None else None

    def cpu_matmul(self, layer: nn.Module) -> CpuMatmul | None:
        """The layer's C++ kernel for float32 CPU inputs: ``(x [M, K], bias, out) -> [M, N]``, or None where no
        C++ kernel serves the layer. Called after ``process_weights_after_loading``."""
        weight = self.bound_weight(layer)
        return weight.cpu_matmul() if weight is not None else None

    def packed_nbytes(self, layer: nn.Module) -> int:
        """Bytes of the layer's weights the method keeps outside its parameters and buffers (packed copies)."""
        weight = self.bound_weight(layer)
        return 0 if weight is None or weight.in_layer_parameters else weight.nbytes()

    def bias_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the layer's bias for activations of ``dtype``: the quantized kernels add a float32 one."""
        return torch.float32


class PackedLinearMethod(LinearMethod):
    """A quantized method whose loaded weight ends as one ``PackedWeight`` in ``layer.qpanels`` (panels for
    the CPU kernels, rows for Triton; ``packed_weight.py``), which multiplies by itself."""

    def bound_weight(self, layer: nn.Module) -> BoundWeight | None:
        return layer.qpanels

    def set_bound_weight(self, layer: nn.Module, weight: BoundWeight) -> None:
        layer.qpanels = weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
        return layer.qpanels.matmul(x, bias, out)


class QuantizationConfig:
    """A quantization scheme chosen for a whole model (``--quantization`` or a checkpoint's config). Each
    scheme registers the names it serves with ``registry.register_quantization_config``."""

    name = "none"
    #: A checkpoint's config.json can name it (``quantization_config.quant_method``): read by ``from_hf``.
    reads_checkpoints: ClassVar[bool] = False

    @classmethod
    def from_flag(cls, method: str, gguf_file: str | None = None) -> QuantizationConfig:
        """The config for ``--quantization method`` (a name the class registered) on a float checkpoint or a
        GGUF file (``gguf_file``)."""
        return cls()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> QuantizationConfig:
        """The config for a checkpoint's ``quantization_config`` (only where ``reads_checkpoints``)."""
        raise NotImplementedError

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        """The method for the layer whose parameters are named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``)."""
        raise NotImplementedError

    def check_dtype(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        """Raise ValueError if the scheme cannot run with activations of ``dtype`` on ``device``: the CPU
        kernels take float32; on CUDA the Triton kernel takes float32, bfloat16 and float16."""
        if platform_for(device).packs_quantized_by_rows:  # the Triton kernel's row layouts (CUDA)
            from pagedllm.kernels.triton_ops import triton_available

            if not triton_available():
                raise ValueError(f"quantization {self.name!r} on CUDA needs triton (it ships with CUDA builds "
                                 "of torch)")
            if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"quantization {self.name!r} on CUDA runs float32, bfloat16 or float16 "
                                 f"activations (got {dtype})")
            return
        if dtype != torch.float32:
            raise ValueError(f"quantization {self.name!r} runs float32 activations on the CPU; "
                             f"use --dtype float32 (got {dtype})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


WeightLoader = Callable[[nn.Parameter, Any, "int | None"], None]
CpuMatmul = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    """Attach ``loader`` as ``param.weight_loader`` and return ``param``."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def shard_range(layer: nn.Module, shard_id: int | None) -> tuple[int, int]:
    """(first row, rows) of shard ``shard_id`` in ``layer.shard_sizes``; the whole output for None."""
    sizes = tuple(layer.shard_sizes)
    if shard_id is None:
        return 0, sum(sizes)
    if not 0 <= shard_id < len(sizes):
        raise ValueError(f"{layer.prefix or type(layer).__name__}: shard {shard_id} out of range "
                         f"(the layer has {len(sizes)} shards)")
    return sum(sizes[:shard_id]), sizes[shard_id]


def check_shape(name: str, loaded: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(loaded) != tuple(expected):
        raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(loaded)}, model {tuple(expected)}")


def load_rows(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
    """Copy ``loaded`` into the rows of ``param`` that belong to shard ``shard_id`` (dim 0 = outputs)."""
    start, rows = shard_range(layer, shard_id)
    dest = param.data.narrow(0, start, rows)
    suffix = "" if shard_id is None else f" (shard {shard_id})"
    check_shape(f"{layer.prefix or 'linear'}{suffix}", tuple(loaded.shape), tuple(dest.shape))
    dest.copy_(loaded)


def to_empty_keeping_loaders(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module.to_empty(device=...)`` that keeps each parameter's attributes (``weight_loader``).

    Moving a parameter off the meta device makes a new ``Parameter`` object, which would drop them.
    """
    attrs = {name: dict(p.__dict__) for name, p in module.named_parameters() if p.__dict__}
    module = module.to_empty(device=device)
    for name, p in module.named_parameters():
        p.__dict__.update(attrs.get(name, {}))
    return module
