"""``LoRAWeight``: a layer's bound weight with the adapters' low-rank terms beside it.

The base matmul runs once for the whole batch, through the weight the layer already had (any form: float panels,
oneDNN bf16, int8 / int4 / GGUF blocks kept quantized); then the step's grouped LoRA term
(``segments.add_lora_term``) adds each adapter row's ``x A B``. The adapters live in slot buffers, A [max_loras, K,
R] and B [max_loras, R, N], zero where a slot holds nothing or a smaller rank. ``R`` is ``shards * max_lora_rank``:
in a fused layer (q/k/v, gate/up) each shard's A fills its own band of R, and its B writes only its own rows, so an
adapter on q alone adds nothing to k or v.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.lora.peft_checkpoint import LoRAModule
from pagedllm.lora.segments import LoRAStepPlan, add_lora_term
from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight


class LoRAStepContext:
    """The plan of the step running now, shared by every ``LoRAWeight`` of a model (None outside a step, or in a
    step where no row carries an adapter)."""

    def __init__(self) -> None:
        self.plan: LoRAStepPlan | None = None


class LoRAWeight(BoundWeight):
    """``base`` (N x K) plus, per slot, a low-rank term; ``shard_sizes``: the output rows of each fused shard."""

    def __init__(self, base: BoundWeight, context: LoRAStepContext, max_loras: int, max_rank: int,
                 shard_sizes: Sequence[int], slots: tuple[torch.Tensor, torch.Tensor] | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.base = base
        self.context = context
        self.out_features, self.in_features = base.out_features, base.in_features
        self.in_layer_parameters = base.in_layer_parameters
        self.max_rank = max_rank
        self.shard_sizes = tuple(shard_sizes)
        width = len(self.shard_sizes) * max_rank
        if slots is None:
            slots = (torch.zeros(max_loras, self.in_features, width, device=device),
                     torch.zeros(max_loras, width, self.out_features, device=device))
        self.a_slots, self.b_slots = slots

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

    def clear_slot(self, slot: int) -> None:
        self.a_slots[slot].zero_()
        self.b_slots[slot].zero_()

    def _shard_rows(self, shard: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:shard])
        return start, start + self.shard_sizes[shard]

    # ---- BoundWeight ---------------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base.matmul(x, bias, out)
        plan = self.context.plan
        return y if plan is None else add_lora_term(y, x, self.a_slots, self.b_slots, plan)

    def fast_matmul(self) -> CpuMatmul:
        base_matmul, context, a_slots, b_slots = self.base.fast_matmul(), self.context, self.a_slots, self.b_slots

        def matmul(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
            y = base_matmul(x, bias, out)
            plan = context.plan
            return y if plan is None else add_lora_term(y, x, a_slots, b_slots, plan)

        return matmul

    def matmul_activation(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor | None:
        # The LoRA term goes in before the activation: fused only in steps with no adapter row.
        return self.base.matmul_activation(x, bias, activation) if self.context.plan is None else None

    def cpu_matmul(self) -> CpuMatmul | None:
        return None  # a step graph records C++ kernels only; the LoRA term is not one

    def nbytes(self) -> int:
        return self.base.nbytes() + (self.a_slots.numel() + self.b_slots.numel()) * self.a_slots.element_size()

    def describe(self) -> str:
        return f"{self.base.describe()} + LoRA"

    def without_tuning_state(self) -> BoundWeight:
        released = self.base.without_tuning_state()
        if released is self.base:
            return self
        return LoRAWeight(released, self.context, self.a_slots.shape[0], self.max_rank, self.shard_sizes,
                          (self.a_slots, self.b_slots))
