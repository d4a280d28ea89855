"""Host memory on its own anonymous mappings: the CPU's KV cache and the model runner's logits buffer."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap

import torch

from pagedllm.logger import init_logger

logger = init_logger(__name__)

HUGE_PAGE = 2 << 20  # x86's transparent huge page


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False,
                       prefault: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor on its own anonymous mapping.

    Pages become resident when first written: lazily by default, so an unused KV block costs no memory (peak
    RSS follows the blocks in use). ``prefault`` writes every page now, on huge pages (fewer TLB misses for
    the attention's scattered block reads, cheaper ``process_vm_readv`` for a KV connector). A page's first
    write is a fault paid by the step touching it, and on a KVM guest whose host backs memory on first touch
    it is dear, by the host's state, with 4 KiB and 2 MiB pages alike: a lazily mapped KV cache spent a large
    share of a fresh 200-request run in faults (figures: docs/performance.md). ``huge_pages``
    asks for transparent huge pages (where the kernel allows them), the tensor starting on a 2 MiB boundary;
    lazily mapped, they round resident memory up by up to 2 MiB per layer half, and a lazily mapped KV cache
    has them only when another process reads it (``advise_huge_pages``, under a KV connector).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    # Huge pages back only whole, aligned 2 MiB pages of a mapping: start the tensor on one.
    huge_pages = huge_pages or prefault
    slack = HUGE_PAGE if huge_pages else 0
    buf = mmap.mmap(-1, max(nbytes + slack, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled in this kernel: plain pages
            pass
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE_PAGE if huge_pages else 0
    # The tensor's storage holds a reference to buf, which keeps the mapping alive.
    used = whole[offset:offset + nbytes]
    if prefault:
        used.zero_()  # torch splits the fill over its threads: the faults run on every core
    return used.view(dtype).view(shape)


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back ``t``'s memory (its whole 2 MiB pages) with transparent huge pages from now on.

    For a KV cache that another process reads with ``process_vm_readv`` (NIXL over UCX's cma transport): the
    kernel pins and maps the source one page at a time, so on 4 KiB pages the call takes longer (figures:
    docs/performance.md). Pages already touched stay small until khugepaged merges them. False where the kernel
    refuses (THP off, not Linux).
    """
    libc = _libc()
    if libc is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    if libc.madvise(start, end - start, mmap.MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with ``madvise`` typed, looked up once (``find_library`` may run ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
