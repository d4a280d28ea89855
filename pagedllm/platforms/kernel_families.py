"""Kernel families by name: "cpu" (the C++ kernels), "triton", "triton-interpreter" (Triton's kernels where they
run interpreted, off a GPU).

A platform decides which family serves an op on its tensors and answers with the family's name; how a family's
module is built and loaded is the kernels layer's business, and the kernels stand above the platforms. So the
kernels layer registers one loader per family here when it is imported (``kernels/registry.py``), and a
platform hands out a family's module through ``kernel_module`` without importing anything above itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_LOADERS: dict[str, Callable[[], Any | None]] = {}


def register_kernel_family(name: str, loader: Callable[[], Any | None]) -> None:
    """Make ``loader`` (the module of family ``name``, or None where it cannot be built here) the family's."""
    _LOADERS[name] = loader


def kernel_module(family: str | None) -> Any | None:
    """The module of kernel family ``family``; None for no family, or one whose kernels are not available here.

    A family nobody registered is an error, not None: a silent None would quietly run the slower torch paths.
    """
    if family is None:
        return None
    loader = _LOADERS.get(family)
    if loader is None:
        raise LookupError(f"kernel family {family!r} has no loader: importing pagedllm.kernels registers them")
    return loader()
