"""Platforms answer kernel family names ("cpu", "triton") and the kernels layer, which stands above them,
registers how each family's module is loaded: a platform hands out modules without importing the kernels."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import triton_ops
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.kernels.registry import family_available, kernels_for
from pagedllm.platforms import CpuPlatform, CudaPlatform, Platform
from pagedllm.platforms.kernel_families import kernel_module


def test_family_names_resolve_to_their_modules() -> None:
    assert kernels_for("cpu") is load_cpu_kernels() is not None
    assert family_available("cpu")
    assert kernels_for(None) is None
    expected = triton_ops.TRITON_OPS if triton_ops.triton_available() else None
    assert kernels_for("triton") is expected
    with pytest.raises(LookupError, match="'flash' has no loader"):
        kernel_module("flash")


def test_platforms_answer_names() -> None:
    cpu, cuda, portable = CpuPlatform(), CudaPlatform(), Platform()
    for dtype in (torch.float32, torch.bfloat16):
        assert cpu.elementwise_family(dtype) == cpu.activation_family(dtype) == "cpu"
        assert cpu.layer_norm_family(dtype) == cpu.step_graph_family(dtype) == "cpu"
        assert cuda.elementwise_family(dtype) == cuda.activation_family(dtype) == "triton"
        assert cuda.layer_norm_family(dtype) is cuda.step_graph_family(dtype) is None
        assert portable.elementwise_family(dtype) is portable.rotary_family(dtype, dtype) is None
    assert cpu.elementwise_family(torch.float16) is None
    assert cpu.rotary_family(torch.bfloat16, torch.float32) is None
    assert cuda.rotary_family(torch.bfloat16, torch.float32) == "triton"


def test_a_platform_hands_out_the_module_its_name_resolves_to() -> None:
    cpu = CpuPlatform()
    assert cpu.elementwise_kernels(torch.float32) is cpu.step_graph_kernels(torch.bfloat16) is load_cpu_kernels()
    assert cpu.layer_norm_kernels(torch.float16) is None
    assert CudaPlatform().activation_kernels(torch.float32) is kernels_for("triton")
