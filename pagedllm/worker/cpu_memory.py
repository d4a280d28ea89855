"""Host memory settings that matter on CPU: page faults are expensive here (~15 us per 4 KiB page on the
VMs we measured), so the allocator keeps freed memory and the KV cache uses transparent huge pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

from pagedllm.logger import init_logger

logger = init_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Stop glibc from returning large freed blocks to the OS.

    By default every tensor above ~128 KiB-32 MiB gets fresh pages from mmap and returns them on free,
    so each step's activations and logits page-fault again (measured: a [200, 49152] logits matmul +
    softmax 168 -> 130 ms, a [200, 576] x [576, 3072] matmul 8.0 -> 5.3 ms). Returns whether it applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    logger.debug("glibc malloc keeps freed memory: %s", ok)
    return ok


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on its own anonymous mapping, backed by transparent huge pages where the
    kernel allows. Pages become resident only when first written, so an unused KV block costs no memory;
    huge pages make that first write one fault per 2 MiB instead of one per 4 KiB.
    """
    nbytes = 1
    for s in shape:
        nbytes *= s
    nbytes *= torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled in this kernel: 4 KiB pages still work
            pass
    # The tensor's storage holds a reference to buf, which keeps the mapping alive.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
