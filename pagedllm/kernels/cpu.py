"""Builds (once, cached on disk) and loads the C++ CPU kernels: paged attention, KV writes, matmul on
packed weights, quantized (int8 / 4-bit) matmuls, inverse-CDF sampling and the fused element-wise ops of a
decoder layer.

They are compiled when a CPU engine starts (the worker loads them) with the system C++ compiler through
``torch.utils.cpp_extension`` (a few minutes on two cores; later processes load the cached build in well under a
second). Where no compiler is available the torch ops are used instead, with a warning.

Two environment variables serve container images (see docs/deployment.md), whose runtime stage has no compiler:
``PAGEDLLM_CPU_MARCH`` (default ``native``) is the ``-march`` the kernels are built for, e.g. ``x86-64-v3`` for
an image that must run on any AVX2 + FMA machine; ``PAGEDLLM_CPU_KERNELS_PREBUILT`` names a library built
earlier (the file, or a folder holding one ``pagedllm_cpu_kernels_*.so``), imported as is with no build step.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils import cpp_extension

from pagedllm import envs
from pagedllm.logger import init_logger

logger = init_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_attention.cpp", "packed_gemm.cpp", "sampling.cpp", "fused_ops.cpp",
            "quant_gemm.cpp", "w8a8_gemm.cpp", "q4_dot_gemm.cpp", "q8_dot_gemm.cpp", "amx_dot_gemm.cpp",
            "encoder_attention.cpp", "encoder_attention_amx.cpp", "encoder_attention_avx512bf16.cpp",
            "encoder_ops.cpp", "bf16_gemm.cpp", "step_graph.cpp", "isa_kernels.cpp", "isa_generic.cpp",
            "isa_avx2.cpp", "isa_avx512.cpp", "isa_vnni512.cpp", "amx_tiles.cpp", "moe_gemm.cpp", "lora_sgmv.cpp",
            "moe_route.cpp", "words_gemm.cpp", "moe_quant_gemm.cpp"]


@functools.cache
def load_cpu_kernels() -> Any | None:
    """The compiled extension module, or None if it cannot be built here (or PAGEDLLM_CPU_KERNELS=0)."""
    if not envs.PAGEDLLM_CPU_KERNELS:
        return None
    prebuilt = envs.PAGEDLLM_CPU_KERNELS_PREBUILT
    if prebuilt:
        return _load_prebuilt(Path(prebuilt))
    try:
        march = envs.PAGEDLLM_CPU_MARCH
        name = kernels_name()
        flags = ["-O3", f"-march={march}", "-fopenmp", "-ffast-math"]
        logger.info("Loading CPU kernels %s (the first time on a machine compiles them: a few minutes)", name)
        with _exclusive_build_directory(name) as folder:
            return cpp_extension.load(name=name, sources=[str(_CSRC / f) for f in _SOURCES],
                                      extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                      build_directory=str(folder), verbose=False)
    except Exception as e:  # no compiler, no ninja, no headers: stay correct, just slower
        logger.warning("CPU kernels unavailable (%s); using the slower torch paths", e)
        return None


def kernels_name() -> str:
    """The extension's name: ``-march=native`` builds are only valid on this CPU kind, so the kind is in it."""
    march = envs.PAGEDLLM_CPU_MARCH
    kind = torch.backends.cpu.get_cpu_capability() if march == "native" else re.sub(r"\W", "_", march)
    return f"pagedllm_cpu_kernels_{kind.lower()}"


@functools.cache
def sources_digest() -> str:
    """A hash of the kernels' sources: what a measurement of them (the autotune table) holds for."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.rglob("*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(str(path.relative_to(_CSRC)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def build_directory(name: str) -> Path:
    """Where ``name`` is built and cached. The folder's name carries a hash of the source path: two checkouts
    never rebuild over each other's build."""
    root = Path(envs.TORCH_EXTENSIONS_DIR or cpp_extension.get_default_build_root())
    return root / f"{name}-{hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def _exclusive_build_directory(name: str) -> Iterator[Path]:
    """The build folder of ``name``, held under an OS file lock for as long as torch builds or loads in it.

    torch's own lock is a file that stays behind when its holder dies (a killed engine process, a server stopped
    during start-up), and every later load then waits on it forever. ``flock`` is released by the kernel when
    its holder dies, so whoever holds it knows a torch lock file left in the folder is stale and removes it.
    """
    folder = build_directory(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "flock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks: torch's own lock file is all there is
            logger.debug("no flock on %s (%s)", folder, e)
            yield folder
            return
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("Removing %s, left by a process that died while building the CPU kernels", stale)
                stale.unlink(missing_ok=True)
            yield folder
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _load_prebuilt(path: Path) -> Any | None:
    """Import a kernels library built ahead of time: no compiler, ninja or source files needed."""
    try:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if path.is_dir():
            found = sorted(path.glob("pagedllm_cpu_kernels_*.so"))
            if len(found) != 1:
                raise FileNotFoundError(f"expected one pagedllm_cpu_kernels_*.so in {path}, found {len(found)}")
            path = found[0]
        # The module name must be the one the library was compiled with (its PyInit_ symbol): the file stem.
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not an importable extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:
        logger.warning("Prebuilt CPU kernels at %s unusable (%s); using the slower torch paths", path, e)
        return None
    logger.info("Loaded prebuilt CPU kernels from %s", path)
    return module


# Instruction set of the quantized matmul kernels (their ``isa`` argument). They pick the best one the CPU
# has at run time; PAGEDLLM_CPU_ISA=avx2|avx512|generic forces one (tests and benchmarks compare them).
ISA_CODES = {"auto": 0, "avx2": 1, "avx512": 2, "generic": 3}


@functools.cache
def cpu_isa() -> int:
    """The ``isa`` code passed to the quantized kernels: PAGEDLLM_CPU_ISA (read once), default auto (0)."""
    return ISA_CODES[envs.PAGEDLLM_CPU_ISA]
