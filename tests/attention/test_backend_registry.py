"""The platform names the attention backends that may serve a request, best first; the registry next to the
backends makes the first whose kernels are available, once per platform and name."""

from __future__ import annotations

import pytest

from pagedllm.attention.backends import registry
from pagedllm.attention.backends.cpu_paged import CpuPagedAttentionBackend
from pagedllm.attention.backends.registry import get_attention_backend
from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.kernels.registry import family_available
from pagedllm.platforms import CpuPlatform, CudaPlatform, Platform


def test_platforms_answer_backend_names() -> None:
    assert CpuPlatform().attention_backend_choices() == ("cpu", "torch")
    assert CpuPlatform().attention_backend_choices("torch") == ("torch",)
    assert CudaPlatform().attention_backend_choices("auto") == ("triton", "torch")
    assert CudaPlatform().attention_backend_choices("triton") == ("triton",)
    assert Platform().attention_backend_choices() == ("torch",)
    with pytest.raises(ValueError, match="'triton' does not run on the cpu platform"):
        CpuPlatform().attention_backend_choices("triton")
    with pytest.raises(ValueError, match="must be one of auto, cpu, torch, triton"):
        Platform().attention_backend_choices("flash")


def test_auto_takes_the_first_choice_whose_kernels_load(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(get_attention_backend(CpuPlatform())) is CpuPagedAttentionBackend
    monkeypatch.setattr(registry, "family_available", lambda family: False)  # as where the C++ build failed
    assert type(get_attention_backend(CpuPlatform())) is TorchPagedAttentionBackend
    with pytest.raises(ValueError, match="'triton' needs triton"):
        get_attention_backend(CudaPlatform(), "triton")


def test_each_platform_and_name_gets_its_own_backend_once() -> None:
    cpu, portable = CpuPlatform(), Platform()
    assert get_attention_backend(cpu, "auto") is get_attention_backend(cpu, "auto")
    assert get_attention_backend(cpu, "auto") is not get_attention_backend(cpu, "cpu")
    assert get_attention_backend(portable) is not get_attention_backend(cpu, "torch")


@pytest.mark.skipif(not family_available("triton"), reason="triton is a test dependency")
def test_cuda_attends_through_triton_with_a_torch_fallback() -> None:
    from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend

    backend = get_attention_backend(CudaPlatform())
    assert type(backend) is TritonPagedAttentionBackend
    assert type(backend.fallback) is TorchPagedAttentionBackend
