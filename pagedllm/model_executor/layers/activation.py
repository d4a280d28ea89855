"""Activations: gated ones on a fused [gate | up] input, and plain ones, looked up by HF name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.kernels.registry import kernels_for
from pagedllm.model_executor.layers.kernel_binding import KernelBinding
from pagedllm.platforms import platform_of


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> silu(gate) * up, [T, I] (one fused pass where the platform has one:
    CUDA, and the CPU in float32 and bf16). Asks the platform on each call; a model's MLPs use ``SiluAndMul``."""
    return _silu_and_mul(gate_up, kernels_for(platform_of(gate_up).activation_family(gate_up.dtype)))


def _silu_and_mul(gate_up: torch.Tensor, kernels: Any | None) -> torch.Tensor:
    if kernels is not None and gate_up.dim() == 2:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul:
    """``silu_and_mul`` for one layer, its kernels bound at the first call (one per MLP: ``gated_activation``)."""

    __slots__ = ("_kernels",)

    def __init__(self) -> None:
        self._kernels = KernelBinding(lambda platform, dtype: platform.activation_family(dtype))

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _silu_and_mul(gate_up, self._kernels(gate_up))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> gelu_tanh(gate) * up, [T, I] (GeGLU, as Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> gelu(gate) * up (exact erf GELU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


class ClampedSwiGLU:
    """gpt-oss's gated activation on gate_up [T, 2I] laid out [gate | up] -> [T, I]: the gate clamped from above
    and the up projection to [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)`` (transformers'
    ``GptOssExperts._apply_gate``; alpha 1.702 and limit 7 in gpt-oss's config)."""

    __slots__ = ("alpha", "limit")

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = float(alpha), float(limit)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


_GATED = {"silu": silu_and_mul, "swish": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul,
          "gelu_new": gelu_tanh_and_mul, "gelu_fast": gelu_tanh_and_mul, "gelu": gelu_and_mul}
_PLAIN = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
          "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
          "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
          "gelu_fast": lambda x: F.gelu(x, approximate="tanh")}


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fused act(gate) * up for an HF ``hidden_act`` name, one per layer (SiLU binds its kernels once);
    ValueError names the supported ones."""
    if name not in _GATED:
        raise ValueError(f"hidden_act {name!r} is not supported for gated MLPs (supported: {', '.join(_GATED)})")
    act = _GATED[name]
    return SiluAndMul() if act is silu_and_mul else act


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A plain activation by HF name (``gelu_new`` is GPT-2's tanh approximation)."""
    if name not in _PLAIN:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(_PLAIN)})")
    return _PLAIN[name]
