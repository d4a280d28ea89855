"""Activations: gated ones on a fused [gate | up] input, and plain ones, looked up by HF name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.platforms import platform_of


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> silu(gate) * up, [T, I] (one fused pass where the platform has one:
    CUDA, and the CPU in float32 and bf16)."""
    kernels = platform_of(gate_up).activation_kernels(gate_up.dtype)
    if kernels is not None and gate_up.dim() == 2:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> gelu_tanh(gate) * up, [T, I] (GeGLU, as Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> gelu(gate) * up (exact erf GELU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


_GATED = {"silu": silu_and_mul, "swish": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul,
          "gelu_new": gelu_tanh_and_mul, "gelu_fast": gelu_tanh_and_mul, "gelu": gelu_and_mul}
_PLAIN = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
          "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
          "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
          "gelu_fast": lambda x: F.gelu(x, approximate="tanh")}


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fused act(gate) * up for an HF ``hidden_act`` name; ValueError names the supported ones."""
    if name not in _GATED:
        raise ValueError(f"hidden_act {name!r} is not supported for gated MLPs (supported: {', '.join(_GATED)})")
    return _GATED[name]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A plain activation by HF name (``gelu_new`` is GPT-2's tanh approximation)."""
    if name not in _PLAIN:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(_PLAIN)})")
    return _PLAIN[name]
