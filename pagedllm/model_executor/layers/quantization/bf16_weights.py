"""bfloat16 weights on a CPU with native bf16, as one ``BoundWeight`` form: oneDNN's prepacked layout and/or the
C++ kernels' bf16 panels, per bucket of rows.

The weight is prepacked after loading into oneDNN's blocked layout (``torch.ops.mkldnn._linear_pointwise``,
the op torch.compile's CPU backend emits). That skips oneDNN's per-call weight reorder and fuses bias and GELU /
ReLU into the matmul. Where the C++ kernels have AVX-512 BF16 (``bf16_gemm``), the plain weight is kept until the
autotuner (``kernel_choice.py``) has timed the bf16 panels against oneDNN; buckets of rows the panels win run
them, and oneDNN's copy goes where no bucket runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedllm.kernels.autotune import BUCKET_ROWS, bucket_index
from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight
from pagedllm.model_executor.layers.quantization.float_weights import nbytes_of, pack_bf16_weight, per_bucket

# Activations oneDNN fuses into the matmul: name -> (post-op, algorithm)
ONEDNN_ACTIVATIONS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


def onednn_kernel(onednn: torch.Tensor) -> CpuMatmul:
    """oneDNN's matmul on its prepacked weight; a given ``out`` receives a copy of the result."""

    def onednn_kernel(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), onednn, bias, "none", [], "")
        return out.copy_(y) if out is not None else y

    return onednn_kernel


def panels_kernel(kernels: Any, weight: torch.Tensor, n: int) -> CpuMatmul:
    """``bf16_gemm`` on panels [ceil(N/16), K/2, 16, 2]; a float32 ``out`` (the LM head's logits) gets a copy."""
    gemm = kernels.bf16_gemm

    def panels(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        if out is None or out.dtype == torch.bfloat16:
            return gemm(x, weight, n, bias, out)
        return out.copy_(gemm(x, weight, n, bias, None))  # a float32 destination (the LM head's logits)

    return panels


class Bf16Weight(BoundWeight):
    """A bf16 weight [N, K]: ``onednn`` (oneDNN's blocked layout) and/or ``panels`` (``pack_bf16_weight``), one of
    ``CANDIDATES`` per bucket of rows in ``choices``. ``source``: the plain weight [N, K], kept for the autotuner
    only (not counted; ``without_tuning_state`` drops it); ``kernels``: the C++ kernels module (None where they
    have no AVX-512 BF16 path: oneDNN only)."""

    CANDIDATES = ("onednn", "panels")  # the first: the packing's own kernel

    def __init__(self, onednn: torch.Tensor | None, panels: torch.Tensor | None, source: torch.Tensor | None,
                 out_features: int, in_features: int, kernels: Any, choices: Sequence[str] | None = None) -> None:
        self.onednn, self.panels, self.source = onednn, panels, source
        self.out_features, self.in_features = out_features, in_features
        self.kernels = kernels
        self.choices = tuple(choices or ("onednn",) * len(BUCKET_ROWS))
        self._onednn = onednn_kernel(onednn) if onednn is not None else None
        self._panels = panels_kernel(kernels, panels, out_features) if panels is not None else None
        self._panel_buckets = tuple(name == "panels" for name in self.choices)
        self._kernel = self._bind()
        self._source_panels: torch.Tensor | None = None  # packed from ``source`` once, for timing and choices

    @classmethod
    def pack(cls, weight: torch.Tensor, kernels: Any | None) -> Bf16Weight:
        """weight bf16 [N, K] -> oneDNN's layout, every bucket on it; with ``kernels`` (bf16 panels available,
        K even) the plain weight is kept for the autotuner."""
        n, k = weight.shape
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        return cls(onednn, None, weight.detach() if kernels is not None else None, n, k, kernels)

    def _bind(self) -> CpuMatmul:
        if self._panels is None:
            return self._onednn
        tuned = per_bucket({"onednn": self._onednn, "panels": self._panels}, self.choices)
        onednn = self._onednn
        if onednn is None:
            return tuned  # bf16_gemm refuses other activations by name

        def by_dtype(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
            return tuned(x, bias, out) if x.dtype == torch.bfloat16 else onednn(x, bias, out)

        return by_dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel(x, bias, out)

    def fast_matmul(self) -> CpuMatmul:
        return self._kernel

    def matmul_activation(self, x: torch.Tensor, bias: torch.Tensor | None,
                          activation: str) -> torch.Tensor | None:
        if activation not in ONEDNN_ACTIVATIONS:
            return None
        if self._panels is not None and x.dtype == torch.bfloat16 and self._panel_buckets[bucket_index(x.shape[0])]:
            y = self._panels(x, bias, None)
            if activation == "relu":
                return y.relu_()
            self.kernels.gelu_(y, activation == "gelu_tanh")
            return y
        op, algorithm = ONEDNN_ACTIVATIONS[activation]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn, bias, op, [], algorithm)

    def nbytes(self) -> int:
        return nbytes_of(self.onednn, self.panels)

    def describe(self) -> str:
        if self.panels is not None:
            return f"bfloat16 (panels{' + oneDNN' if self.onednn is not None else ''})"
        return "bfloat16 (oneDNN packed)"

    def without_tuning_state(self) -> Bf16Weight:
        if self.source is None:
            return self
        return Bf16Weight(self.onednn, self.panels, None, self.out_features, self.in_features, self.kernels,
                          self.choices)

    # The autotuner's side (kernel_choice.py).
    def tuning_key(self) -> str:
        return f"Bf16:{self.out_features}x{self.in_features}"

    def candidates(self) -> dict[str, Callable[[], CpuMatmul]] | None:
        """name -> a maker of that kernel, to time; None where there is nothing to choose (no plain weight
        kept, or already tuned)."""
        if self.source is None or self.onednn is None or self.panels is not None:
            return None
        return {"onednn": lambda: self._onednn,
                "panels": lambda: panels_kernel(self.kernels, self._packed_source(), self.out_features)}

    def _packed_source(self) -> torch.Tensor:
        if self._source_panels is None:
            self._source_panels = pack_bf16_weight(self.source)
        return self._source_panels

    def with_choices(self, choices: Sequence[str]) -> Bf16Weight:
        """This weight running ``choices[b]`` for bucket b: itself where that is oneDNN everywhere; the panels
        everywhere drop oneDNN's copy, a mix keeps both. The plain weight stays until ``without_tuning_state``."""
        if "panels" not in choices:
            return self
        onednn = self.onednn if "onednn" in choices else None
        return Bf16Weight(onednn, self._packed_source(), self.source, self.out_features, self.in_features,
                          self.kernels, choices)

    def extra_copy_nbytes(self) -> int:
        """Bytes of the second copy a mix of kernels keeps (0 for one kernel everywhere)."""
        return nbytes_of(self.panels) if self.onednn is not None and self.panels is not None else 0
