"""The kernel families by name, as the platforms name them ("cpu", "triton", "triton-interpreter"): how each
family's module is loaded, and whether it is available here. Registered with the platforms on import (``import
pagedllm.kernels`` does it), so that a platform's ``cpu_kernels`` / ``elementwise_kernels`` ... resolve the names
it answers with (``platforms/kernel_families.py``)."""

from __future__ import annotations

from typing import Any

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.platforms.kernel_families import kernel_module, register_kernel_family


def _triton_ops() -> Any | None:
    """Triton's element-wise ops (imported on the first ask only: CPU processes never load triton), or None
    where triton is not installed."""
    from pagedllm.kernels import triton_ops

    return triton_ops.TRITON_OPS if triton_ops.triton_available() else None


def _interpreted_triton_ops() -> Any | None:
    """Triton's ops where they run off a GPU: under Triton's interpreter (``TRITON_INTERPRET=1``), else None."""
    from pagedllm.kernels import triton_ops

    return _triton_ops() if triton_ops.interpreted() else None


register_kernel_family("cpu", load_cpu_kernels)
register_kernel_family("triton", _triton_ops)
register_kernel_family("triton-interpreter", _interpreted_triton_ops)


#: The module of kernel family ``family`` (a name a platform answered with), or None: none, or not available here.
kernels_for = kernel_module


def family_available(family: str) -> bool:
    """Whether family ``family``'s kernels load here: the C++ kernels built, triton installed."""
    return kernel_module(family) is not None


__all__ = ["family_available", "kernels_for"]
