"""``BoundWeight``: the one interface of every linear weight form, float or quantized.

A layer's weight [N, K] ends, after loading, as one object in the layout of the kernel that reads it, with that
kernel (and every choice about it: ISA, layout, a second kernel for some buckets of rows) bound when the object
is made. Quantized forms are ``PackedWeight`` (``packed_weight.py``: ``qpanels.py``, ``qrows.py``); float forms
are in ``float_weights.py`` (plain ``F.linear``, float32 panels) and ``bf16_weights.py`` (oneDNN's prepacked
layout, bf16 panels). ``Linear`` holds one through its method and calls it; nothing dispatches on the form.
A LoRA term sits beside ``matmul``; MoE experts stack the same forms.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedllm.model_executor.layers.quantization.base import CpuMatmul


class BoundWeight:
    """One weight ``out_features`` x ``in_features`` (N x K), its kernel bound. The autotuner's choice of kernels
    per bucket of rows is a new float object (``with_choices``) or a quantized weight's kernel rebound
    (``PackedWeight.rebind``); ``Linear.bind_weight`` makes it the layer's."""

    out_features: int
    in_features: int
    #: The weight is the layer's own ``weight`` parameter (``nbytes`` is then counted with the parameters).
    in_layer_parameters: ClassVar[bool] = False

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> x @ W^T + bias [M, N]. ``out``: an optional [M, N] destination the form may write
        (returned when it does); callers use the result either way."""
        raise NotImplementedError

    def fast_matmul(self) -> CpuMatmul:
        """``matmul`` as the one callable ``Linear.forward`` keeps and calls per batch:
        ``(x [M, K], bias [N] | None, out [M, N] | None) -> [M, N]``. A form whose kernel takes every input the
        layer gets returns that kernel, so a flat batch is one Python call into it."""
        return self.matmul

    def matmul_activation(self, x: torch.Tensor, bias: torch.Tensor | None,
                          activation: str) -> torch.Tensor | None:
        """activation(x [M, K] @ W^T + bias) [M, N] in one fused call ("gelu", "gelu_tanh", "relu"), or None
        where the form has none (the caller applies the activation to ``matmul``'s result)."""
        return None

    def cpu_matmul(self) -> CpuMatmul | None:
        """The bound C++ kernel for float32 CPU activations ``(x [M, K], bias, out) -> [M, N]`` (what a CPU step
        graph records), or None where no C++ kernel reads the weight."""
        return None

    def nbytes(self) -> int:
        """Bytes of the tensors the kernels read (every copy kept, one per kernel chosen)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The form for the memory report ("float32", "bfloat16 (oneDNN packed)", ...)."""
        return type(self).__name__

    def without_tuning_state(self) -> BoundWeight:
        """This weight without what it kept only for the autotuner (itself where it kept nothing)."""
        return self
