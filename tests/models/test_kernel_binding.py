"""Layers bind their kernels once per (device, dtype): the platform is asked for a kernel family at a layer's first
call, not on every forward, and the bound kernels give what the platform's kernels give."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers.activation import gated_activation, silu_and_mul
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm, LayerNorm, RMSNorm
from pagedllm.platforms import platform_for


@pytest.fixture
def asks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the CPU platform's answers to the layers' questions."""
    cpu = platform_for("cpu")
    counts: dict[str, int] = {}
    for method in ("elementwise_family", "layer_norm_family", "activation_family"):
        answer = getattr(cpu, method)

        def counted(dtype: torch.dtype, _answer=answer, _method=method):  # noqa: ANN202
            counts[_method] = counts.get(_method, 0) + 1
            return _answer(dtype)

        monkeypatch.setattr(cpu, method, counted)
    return counts


def test_norms_and_activations_ask_once_per_dtype(asks: dict[str, int]) -> None:
    torch.manual_seed(0)
    norm, gemma_norm, layer_norm, act = RMSNorm(16), GemmaRMSNorm(16), LayerNorm(16), gated_activation("silu")
    for _ in range(3):
        x = torch.randn(4, 16)
        norm(x)
        gemma_norm(x)
        layer_norm(x)
        act(torch.randn(4, 32))
    assert asks == {"elementwise_family": 2, "layer_norm_family": 1, "activation_family": 1}
    act(torch.randn(4, 32, dtype=torch.bfloat16))  # a new dtype: asked again
    assert asks["activation_family"] == 2


def test_each_layer_binds_its_own_kernels() -> None:
    assert gated_activation("silu") is not gated_activation("silu")  # one per MLP
    assert gated_activation("gelu_pytorch_tanh") is gated_activation("gelu_pytorch_tanh")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_kernels_give_what_the_platforms_kernels_give(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    kernels = platform_for("cpu").elementwise_kernels(dtype)
    gate_up = torch.randn(5, 64, dtype=dtype)
    act = gated_activation("silu")
    for _ in range(2):
        assert torch.equal(act(gate_up), silu_and_mul(gate_up))
        assert torch.equal(act(gate_up), kernels.silu_and_mul(gate_up))
    norm = RMSNorm(32, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    for _ in range(2):
        assert torch.equal(norm(x), kernels.rms_norm(x, norm.weight, norm.eps))
    out, summed = norm(x.clone(), residual.clone())
    x_ref, residual_ref = x.clone(), residual.clone()
    kernels.rms_norm_(x_ref, residual_ref, norm.weight, norm.eps)
    assert torch.equal(out, x_ref) and torch.equal(summed, residual_ref)
