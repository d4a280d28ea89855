"""A dispatch mode that records aten ops a CUDA graph or a sync-free GPU step must not run: ops that read a
tensor value on the host (``.item()``, ``bool(t)``, ``nonzero``, boolean-mask indexing, ``repeat_interleave``
without ``output_size``) and lifts of host data into a tensor (``torch.tensor(list)`` inside the step). A 0-dim
lift is a Python scalar taking part in an op (``t[i] = 0.0``), which CUDA kernels take by value: not recorded.

Usable from every test folder: ``from helpers.host_reads import HostReads``.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default}


class HostReads(TorchDispatchMode):
    """``with HostReads() as watch: ...`` then ``watch.seen`` lists the offending op names in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if func in _HOST_READS:
            self.seen.append(name)
        elif func is torch.ops.aten.lift_fresh.default and args[0].dim() > 0:
            self.seen.append(name)
        elif func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.seen.append(name + " (boolean mask)")
        elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.seen.append(name + " (no output_size)")
        return func(*args, **kwargs)
