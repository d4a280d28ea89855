"""``PackedWeight``: one quantized weight [N, K] in the layout of the kernel that reads it, with that kernel
bound once (the quantized ``BoundWeight`` forms; ``bound_weight.py``).

Every format is its own subclass (``qpanels.py``: the C++ CPU kernels' panels; ``qrows.py``: the Triton
kernel's rows). A subclass knows how its bytes dequantize and which kernel multiplies by them; the choice of
kernel (and, on the CPU, of ISA) is made when the weight is packed, not on every call. Where no kernel serves
the weight (no compiler, another device, activations the kernel does not take) ``matmul`` dequantizes and
calls ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight


@dataclass(frozen=True, eq=False)
class PackedWeight(BoundWeight):
    """``qweight`` (the quantized levels in the subclass's layout), ``scales`` and, for 4-bit formats,
    ``mins`` per (row, group of ``group`` inputs); ``out_features`` x ``in_features`` = N x K. Frozen: the
    bound kernel holds these tensors."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    out_features: int
    in_features: int
    #: ``bind()`` at packing time: ``(x [M, K], bias [N] | None, out [M, N] | None) -> [M, N]``, or None.
    _kernel: CpuMatmul | None = field(init=False, repr=False)

    #: Name of the layout (``layout == "dot8"``...), for reports and tests: nothing dispatches on it.
    layout: ClassVar[str] = ""
    #: Whether the levels are 4-bit with a minimum per group (w = scale * q + min).
    is_q4: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_kernel", self.bind())

    def bind(self, isa: int | None = None) -> CpuMatmul | None:
        """This format's kernel for the platform the weight lives on, every choice made now (``isa``: the C++
        kernels' ISA code, default ``cpu_isa()``; unused by other kernels), or None where none serves it."""
        raise NotImplementedError

    def rebind(self, kernel: CpuMatmul) -> PackedWeight:
        """This weight with ``kernel`` as its bound kernel instead (the autotuner's choice per bucket of rows, which
        reads this weight's tensors and those of its other layouts); returns itself."""
        object.__setattr__(self, "_kernel", kernel)
        return self

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the bound kernel multiplies activations like ``x`` (dtype)."""
        return True

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (reference and fallback path)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               isa: int | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] (+ bias) in x's dtype; ``out``: optional [M, N] destination, returned when given.
        ``isa`` binds the kernel for that ISA code instead (comparisons, tests)."""
        kernel = self._kernel if isa is None else self.bind(isa)
        if kernel is not None and self.takes(x):
            return kernel(x, bias, out)
        y = F.linear(x, self.dequantize().to(x.dtype), None if bias is None else bias.to(x.dtype))
        return out.copy_(y) if out is not None else y

    def cpu_matmul(self) -> CpuMatmul | None:
        """The bound C++ kernel for float32 CPU activations (what a CPU step graph records), or None where the
        weight is not read by one."""
        return None

    def describe(self) -> str:
        return self.layout
