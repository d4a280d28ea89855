"""A layer's kernels, bound once: the platform of the layer's tensors is asked which kernel family serves their
dtype the first time the layer sees that (device, dtype), not on every forward, and the kernels registry turns the
name into the module. A layer lives on one device in one dtype, so after its first call the binding is one
dictionary lookup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.kernels.registry import kernels_for
from pagedllm.platforms import Platform, platform_of

_UNBOUND = object()


class KernelBinding:
    """The module of the kernel family that ``ask(platform, dtype)`` names for tensors like ``t`` (None: the torch
    ops), asked once per (device, dtype). One per layer instance: a test that swaps a platform's answers builds its
    model afterwards and sees them."""

    __slots__ = ("_ask", "_bound")

    def __init__(self, ask: Callable[[Platform, torch.dtype], str | None]) -> None:
        self._ask = ask
        self._bound: dict[tuple[torch.device, torch.dtype], Any | None] = {}

    def __call__(self, t: torch.Tensor) -> Any | None:
        key = (t.device, t.dtype)
        kernels = self._bound.get(key, _UNBOUND)
        if kernels is _UNBOUND:
            kernels = self._bound[key] = kernels_for(self._ask(platform_of(t), t.dtype))
        return kernels
