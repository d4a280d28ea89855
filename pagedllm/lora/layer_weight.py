"""``LoRAWeight``: a layer's bound weight with the adapters' low-rank terms beside it.

The base matmul runs once for the whole batch, through the weight the layer already had (any form: float panels,
oneDNN bf16, int8 / int4 / GGUF blocks kept quantized); then the step's LoRA term adds each adapter row's ``x A B``:
on the CPU one call of the C++ kernel ``lora_sgmv_`` (``kernels/csrc/lora_sgmv.cpp``), which reads each row's slot
from ``LoRAStepContext.row_slots`` and can therefore be recorded in a CPU step graph; elsewhere (or without the
kernels) the grouped torch ops of ``segments.add_lora_term``, the reference. The adapters live in slot buffers,
A [max_loras, K, R] and B [max_loras, R, N], zero where a slot holds nothing or a smaller rank. ``R`` is
``shards * max_lora_rank``: in a fused layer (q/k/v, gate/up) each shard's A fills its own band of R, and its B
writes only its own rows, so an adapter on q alone adds nothing to k or v.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedllm.lora.peft_checkpoint import LoRAModule
from pagedllm.lora.segments import LoRAStepPlan, add_lora_term
from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight


class LoRAStepContext:
    """What every ``LoRAWeight`` of a model reads in the step running now.

    ``kernel``: a ``lora_sgmv_``, the C++ one or Triton's on CUDA (None: the torch path). With it, ``row_slots``
    [capacity] int32, on the model's device, holds each row's slot (-1: the base model; every entry -1 outside a
    step, so the padded rows of a replayed step graph add nothing) and ``active`` says whether the layers call it (a
    step with an adapter row, or a step graph recording: the call must be in the graph). Without it, ``plan`` is
    the step's grouped-term plan (None: nothing to add).
    """

    def __init__(self, kernel: Callable[..., None] | None = None, capacity: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.plan: LoRAStepPlan | None = None
        self.kernel = kernel
        self.active = False
        self.row_slots = torch.full((capacity if kernel is not None else 0,), -1, dtype=torch.int32, device=device)

    def add_term(self, y: torch.Tensor, x: torch.Tensor, weight: LoRAWeight) -> torch.Tensor:
        """y [T, N] += each adapter row's term of x [T, K] (in place; returns y)."""
        if self.kernel is not None:  # given for float32 / bf16 models (C++) or on CUDA (Triton): worker.py
            if self.active:
                self.kernel(y, x, weight.a_slots, weight.b_slots, weight.slot_ranks, weight.max_rank,
                            self.row_slots[:x.shape[0]], weight.band_cols)
            return y
        plan = self.plan
        return y if plan is None else add_lora_term(y, x, weight.a_slots, weight.b_slots, plan)

    @property
    def adds_terms(self) -> bool:
        """Whether the layers may add a term this step (a fused matmul + activation must not run then)."""
        return self.active if self.kernel is not None else self.plan is not None


class LoRAWeight(BoundWeight):
    """``base`` (N x K) plus, per slot, a low-rank term; ``shard_sizes``: the output rows of each fused shard;
    ``dtype``: the slot buffers' (float32; bf16 beside a bf16 model with the C++ kernel, as vLLM keeps adapters in
    the model's dtype)."""

    def __init__(self, base: BoundWeight, context: LoRAStepContext, max_loras: int, max_rank: int,
                 shard_sizes: Sequence[int], slots: tuple[torch.Tensor, torch.Tensor] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.base = base
        self.context = context
        self.out_features, self.in_features = base.out_features, base.in_features
        self.in_layer_parameters = base.in_layer_parameters
        self.max_rank = max_rank
        self.shard_sizes = tuple(shard_sizes)
        width = len(self.shard_sizes) * max_rank
        if slots is None:
            slots = (torch.zeros(max_loras, self.in_features, width, device=device, dtype=dtype),
                     torch.zeros(max_loras, width, self.out_features, device=device, dtype=dtype))
        self.a_slots, self.b_slots = slots
        # The rank each slot's bands use here (0: the adapter has no module on this layer): the kernel reads
        # only those columns of A and rows of B.
        self.slot_ranks = torch.zeros(self.a_slots.shape[0], dtype=torch.int32, device=self.a_slots.device)
        # The output columns [lo, hi) each band of a slot writes (lo == hi: no module there): the kernels skip a
        # band's rows of B outside them (a fused layer's shard) and a band no module fills.
        self.band_cols = torch.zeros(self.a_slots.shape[0], len(self.shard_sizes), 2, dtype=torch.int32,
                                     device=self.a_slots.device)

    # ---- the adapters in slots -----------------------------------------------------------------------------
    def set_slot(self, slot: int, modules: dict[int | None, LoRAModule]) -> None:
        """Put one adapter's modules of this layer in ``slot`` (keys: shard index, or None for the whole layer);
        everything else of the slot becomes zero."""
        self.clear_slot(slot)
        for shard, module in modules.items():
            rows = (0, self.out_features) if shard is None else self._shard_rows(shard)
            band = 0 if shard is None else shard * self.max_rank
            rank = module.rank
            if module.b.shape[0] != rows[1] - rows[0] or module.a.shape[1] != self.in_features:
                raise ValueError(f"LoRA: a module of shape A {tuple(module.a.shape)}, B {tuple(module.b.shape)} does "
                                 f"not fit this layer's rows {rows} of {self.in_features} inputs")
            self.a_slots[slot, :, band:band + rank] = module.a.t()
            self.b_slots[slot, band:band + rank, rows[0]:rows[1]] = module.b.t()
            self.slot_ranks[slot] = max(int(self.slot_ranks[slot]), rank)
            self.band_cols[slot, 0 if shard is None else shard] = torch.tensor(rows, dtype=torch.int32)

    def clear_slot(self, slot: int) -> None:
        self.a_slots[slot].zero_()
        self.b_slots[slot].zero_()
        self.slot_ranks[slot] = 0
        self.band_cols[slot] = 0

    def _shard_rows(self, shard: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:shard])
        return start, start + self.shard_sizes[shard]

    # ---- BoundWeight ---------------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self.context.add_term(self.base.matmul(x, bias, out), x, self)

    def fast_matmul(self) -> CpuMatmul:
        base_matmul, add_term = self.base.fast_matmul(), self.context.add_term

        def matmul(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
            return add_term(base_matmul(x, bias, out), x, self)

        return matmul

    def matmul_activation(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor | None:
        # The LoRA term goes in before the activation: fused only in steps that add no term.
        return None if self.context.adds_terms else self.base.matmul_activation(x, bias, activation)

    def cpu_matmul(self) -> CpuMatmul | None:
        return None  # the kernel autotuner times the base weight alone

    def nbytes(self) -> int:
        return self.base.nbytes() + (self.a_slots.numel() + self.b_slots.numel()) * self.a_slots.element_size()

    def describe(self) -> str:
        return f"{self.base.describe()} + LoRA"

    def without_tuning_state(self) -> BoundWeight:
        released = self.base.without_tuning_state()
        if released is self.base:
            return self
        weight = LoRAWeight(released, self.context, self.a_slots.shape[0], self.max_rank, self.shard_sizes,
                            (self.a_slots, self.b_slots))
        weight.slot_ranks, weight.band_cols = self.slot_ranks, self.band_cols
        return weight
