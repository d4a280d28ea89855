"""Builds (once, cached on disk) and loads the C++ CPU kernels: paged attention, KV writes, matmul on
packed weights, quantized (int8 / 4-bit) matmuls, inverse-CDF sampling and the fused element-wise ops of a
decoder layer.

They are compiled when a CPU engine starts (the worker loads them) with the system C++ compiler through
``torch.utils.cpp_extension`` (one to two minutes; later processes load the cached build in well under a
second). Where no compiler is available the torch ops are used instead, with a warning.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from pagedllm.logger import init_logger

logger = init_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_attention.cpp", "packed_gemm.cpp", "sampling.cpp", "fused_ops.cpp",
            "quant_gemm.cpp", "w8a8_gemm.cpp"]


@functools.cache
def load_cpu_kernels() -> Any | None:
    """The compiled extension module, or None if it cannot be built here (or PAGEDLLM_CPU_KERNELS=0)."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        # -march=native: the cached build is only valid on this CPU kind, so the kind is in its name.
        name = f"pagedllm_cpu_kernels_{torch.backends.cpu.get_cpu_capability().lower()}"
        flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
        logger.info("Loading CPU kernels %s (the first time on a machine compiles them: one to two minutes)", name)
        return load(name=name, sources=[str(_CSRC / f) for f in _SOURCES], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, no headers: stay correct, just slower
        logger.warning("CPU kernels unavailable (%s); using the slower torch paths", e)
        return None


def kernels_for(t: torch.Tensor) -> Any | None:
    """The CPU kernels when they apply to tensor ``t`` (a float32 CPU tensor), else None."""
    if t.device.type != "cpu" or t.dtype != torch.float32:
        return None
    return load_cpu_kernels()


# Instruction set of the quantized matmul kernels (their ``isa`` argument). They pick the best one the CPU
# has at run time; PAGEDLLM_CPU_ISA=avx2|avx512|generic forces one (tests and benchmarks compare them).
ISA_CODES = {"auto": 0, "avx2": 1, "avx512": 2, "generic": 3}


@functools.cache
def cpu_isa() -> int:
    """The ``isa`` code passed to the quantized kernels: PAGEDLLM_CPU_ISA (read once), default auto (0)."""
    name = os.environ.get("PAGEDLLM_CPU_ISA", "auto").lower()
    if name not in ISA_CODES:
        raise ValueError(f"PAGEDLLM_CPU_ISA={name!r}: expected one of {', '.join(ISA_CODES)}")
    return ISA_CODES[name]
