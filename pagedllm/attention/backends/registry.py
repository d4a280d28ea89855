"""Attention backends by name: the platform answers which names may serve a request ("auto", or one of
``ATTENTION_BACKENDS``), best first; this registry makes the first whose kernels are available here, once per
platform and name (as vLLM's platforms name a backend class that its selector imports)."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.kernels.registry import family_available
from pagedllm.platforms import Platform


def _cpu() -> AttentionBackend:
    from pagedllm.attention.backends.cpu_paged import CpuPagedAttentionBackend

    return CpuPagedAttentionBackend()


def _torch() -> AttentionBackend:
    from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend

    return TorchPagedAttentionBackend()


def _triton() -> AttentionBackend:
    # Imported on the first CUDA ask only, so CPU processes never load triton.
    from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend

    if not family_available("triton"):
        raise ValueError("attention_backend: 'triton' needs triton, which is not installed")
    return TritonPagedAttentionBackend(_torch())


# name -> (how to make it, the kernel family it needs; None: plain torch)
_BACKENDS: dict[str, tuple[Callable[[], AttentionBackend], str | None]] = {
    "cpu": (_cpu, "cpu"),
    "torch": (_torch, None),
    "triton": (_triton, "triton"),
}
_MADE: dict[tuple[Platform, str], AttentionBackend] = {}


def get_attention_backend(platform: Platform, name: str = "auto") -> AttentionBackend:
    """The attention backend ``name`` (one of ``ATTENTION_BACKENDS``) on ``platform``, made once. "auto" takes
    the platform's first choice whose kernels are available; a named one whose kernels are not raises
    ValueError (from the backend), as does a name the platform does not run."""
    backend = _MADE.get((platform, name))
    if backend is None:
        backend = _MADE[(platform, name)] = _make(platform.attention_backend_choices(name))
    return backend


def _make(choices: tuple[str, ...]) -> AttentionBackend:
    for choice in choices[:-1]:
        make, family = _BACKENDS[choice]
        if family is None or family_available(family):
            return make()
    return _BACKENDS[choices[-1]][0]()
