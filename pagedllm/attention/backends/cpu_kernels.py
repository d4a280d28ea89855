"""Builds (once, cached on disk) and loads the C++ CPU paged-attention kernel.

The kernel is compiled on first use with the system C++ compiler through ``torch.utils.cpp_extension``
(about a minute; later processes load the cached build in well under a second). Where no compiler is
available the torch SDPA path is used instead, with a warning.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from pagedllm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def load_cpu_kernels() -> Any | None:
    """The compiled extension module, or None if it cannot be built here (or PAGEDLLM_CPU_KERNELS=0)."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load

        # -march=native: the cached build is only valid on this CPU kind, so the kind is in its name.
        name = f"pagedllm_cpu_attention_{torch.backends.cpu.get_cpu_capability().lower()}"
        flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
        return load(name=name, sources=[str(_SOURCE)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, no headers: stay correct, just slower
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch SDPA path", e)
        return None
