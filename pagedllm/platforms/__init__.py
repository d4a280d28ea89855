"""The one place that decides, per device, which implementation runs: C++ CPU kernels, Triton on CUDA, or
plain torch. Layers, the sampler, the runner and the worker ask their tensor's (or their engine's) platform
instead of testing the device themselves; a test holds that no module outside ``platforms/``, the attention
backends and the kernels does. The platforms stand on the ground floor: they answer with names (an attention
backend's, a kernel family's) that the registries above them resolve (``attention/backends/registry.py``,
``kernels/registry.py``).

``platform_for(device)`` gives the platform of a device, ``platform_of(tensor)`` the one a tensor lives on.
"""

from __future__ import annotations

import torch

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform
from pagedllm.platforms.interface import Platform

_PLATFORMS: dict[str, Platform] = {"cpu": CpuPlatform(), "cuda": CudaPlatform()}


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` ("cpu", "cuda", "cuda:1", a torch.device). Another device type (meta,
    mps) gets the CPU's portable choices: plain torch, no C++ kernels."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    platform = _PLATFORMS.get(kind)
    if platform is None:
        platform = _PLATFORMS[kind] = Platform()
    return platform


def platform_of(t: torch.Tensor) -> Platform:
    """The platform tensor ``t`` lives on (asked per layer and step: one dict lookup on the known devices)."""
    device = t.device
    return _PLATFORMS.get(device.type) or platform_for(device)


__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "platform_for", "platform_of"]
