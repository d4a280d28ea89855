"""The worker's adapters: loaded ones kept in an LRU pool, and per step the slots each layer reads.

``LoRAModelManager`` wraps every layer an adapter may target in a ``LoRAWeight`` once, at start-up. Per step,
``begin_step`` puts the step's adapters in slots (an adapter already in a slot stays; a new one takes a free slot or
the least recently used one that this step does not need) and says which rows carry which slot: with the C++
kernel (or Triton's on CUDA), each row's slot in the context's ``row_slots`` buffer on the model's device (what a
recorded CPU step graph reads at replay, so adapter steps replay graphs too); without one, a grouped-term plan
(``segments.plan_step``). ``end_step`` resets
them. The scheduler never runs more distinct adapters than there
are slots (``SchedulerConfig.max_loras``); the loaded pool (``max_cpu_loras``) drops its least recently used adapter
when full. Adapters are identified by their content digest, checked again when their files are read here.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from pagedllm.logger import init_logger
from pagedllm.lora.layer_weight import LoRAStepContext, LoRAWeight
from pagedllm.lora.peft_checkpoint import LoRAModule, PeftAdapter, adapter_digest, load_peft_adapter
from pagedllm.lora.request import AdapterRef
from pagedllm.lora.segments import plan_step
from pagedllm.lora.target_modules import base_module_shapes, layer_target
from pagedllm.model_executor.layers.linear import Linear

logger = init_logger(__name__)


def choose_lora_kernel(cpu_kernels: object | None, device: torch.device) -> tuple[Callable[..., None] | None, bool]:
    """(the ``lora_sgmv_`` that adds the terms, whether step graphs may record its calls): the C++ kernel where the
    CPU kernels are loaded (recorded in CPU step graphs), Triton's on CUDA where Triton is installed (adapter steps
    run eagerly there: the CUDA graphs hold the base model), else (None, False): the grouped torch ops."""
    kernel = getattr(cpu_kernels, "lora_sgmv_", None)
    if kernel is not None:
        return kernel, True
    if torch.device(device).type == "cuda":
        from pagedllm.kernels import triton_ops

        if triton_ops.triton_available():
            from pagedllm.kernels.triton_lora import lora_sgmv_

            return lora_sgmv_, False
    return None, False


class LoRAModelManager:
    def __init__(self, model: nn.Module, hf_config: object, max_loras: int, max_cpu_loras: int, max_rank: int,
                 device: torch.device, kernel: Callable[..., None] | None = None, max_num_tokens: int = 0,
                 model_dtype: torch.dtype = torch.float32, kernel_in_graphs: bool = False) -> None:
        """``kernel``: a ``lora_sgmv_`` that adds the terms (the C++ CPU kernel, or Triton's on CUDA:
        ``lora_kernel``), None for the torch path; ``kernel_in_graphs``: step graphs may record its calls (the C++
        kernel's, in CPU step graphs); ``max_num_tokens``: the most rows a step (or a recorded step graph) can have;
        ``model_dtype``: with the C++ kernel, a bf16 model keeps its slot buffers in bf16 (half the bytes each
        decode step reads)."""
        self.base_shapes = base_module_shapes(hf_config)
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.device = device
        self.context = LoRAStepContext(kernel, max_num_tokens, device)
        self._kernel_in_graphs = kernel is not None and kernel_in_graphs
        slot_dtype = torch.bfloat16 if self._kernel_in_graphs and model_dtype == torch.bfloat16 else torch.float32
        self._rows_set = 0  # rows of row_slots written by the step running now
        linears = {m.prefix: m for m in model.modules() if isinstance(m, Linear)}
        self.layers: dict[str, LoRAWeight] = {}
        for module, (out_features, in_features) in self.base_shapes.items():
            path, shard = layer_target(module)
            layer = linears.get(path)
            if layer is None or layer.packed is None:
                raise ValueError(f"enable_lora: the model has no layer {path} for LoRA module {module}")
            if path not in self.layers:
                weight = LoRAWeight(layer.packed, self.context, max_loras, max_rank, layer.shard_sizes, device=device,
                                    dtype=slot_dtype)
                layer.bind_weight(weight)
                self.layers[path] = weight
            full = _full_shape(layer, shard)
            if full != (out_features, in_features):
                raise ValueError(f"enable_lora: layer {path} has shape {full} for {module}, "
                                 f"expected {(out_features, in_features)}")
        self.linears = {path: linears[path] for path in self.layers}
        self.loaded: OrderedDict[str, dict[str, dict[int | None, LoRAModule]]] = OrderedDict()
        self.slots: list[str | None] = [None] * max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self.rank_width = 3 * max_rank  # the widest layer (q/k/v): what the tile choice weighs
        logger.info("LoRA: %d layers carry adapters; %d slots, rank up to %d, %d adapters kept loaded; terms by %s "
                    "(%s slots)", len(self.layers), max_loras, max_rank, max_cpu_loras,
                    "grouped torch ops" if kernel is None else
                    "the C++ kernel lora_sgmv_" if kernel_in_graphs else "the Triton kernel lora_sgmv_",
                    str(slot_dtype).removeprefix("torch."))

    @property
    def graphs_hold_adapters(self) -> bool:
        """Whether step graphs recorded under ``recording_graphs`` run adapter steps too (the C++ kernel's call
        is in them, reading each row's slot at replay; CUDA graphs hold the base model only)."""
        return self._kernel_in_graphs

    @contextlib.contextmanager
    def recording_graphs(self) -> Iterator[None]:
        """While step graphs record: every layer calls the kernel (on rows of slot -1, adding nothing), so the
        call is part of each graph."""
        self.context.active = self.graphs_hold_adapters
        try:
            yield
        finally:
            self.context.active = False

    # ---- the loaded pool -----------------------------------------------------------------------------------
    def _load(self, ref: AdapterRef) -> dict[str, dict[int | None, LoRAModule]]:
        by_layer = self.loaded.get(ref.digest)
        if by_layer is not None:
            self.loaded.move_to_end(ref.digest)
            return by_layer
        digest = adapter_digest(ref.path)
        if digest != ref.digest:
            raise ValueError(f"LoRA adapter {ref.name!r}: the files at {ref.path} changed since it was loaded; "
                             "load it again")
        adapter: PeftAdapter = load_peft_adapter(ref.path, self.base_shapes, self.max_rank, digest)
        by_layer = {}
        for module, lora in adapter.modules.items():
            path, shard = layer_target(module)
            by_layer.setdefault(path, {})[shard] = rank_part(self.linears[path], shard, lora)
        while len(self.loaded) >= self.max_cpu_loras:
            evicted = next((d for d in self.loaded if d not in self.slots), None)
            if evicted is None:
                break
            del self.loaded[evicted]
        self.loaded[ref.digest] = by_layer
        logger.info("LoRA: loaded adapter %r (id %d, rank %d, %d modules)", ref.name, ref.int_id,
                    adapter.max_rank, len(adapter.modules))
        return by_layer

    # ---- slots -----------------------------------------------------------------------------------------------
    def _activate(self, refs: dict[str, AdapterRef]) -> dict[str, int]:
        """Slot of each adapter of the step (digest -> slot), loading the ones not in a slot."""
        if len(refs) > self.max_loras:
            raise RuntimeError(f"LoRA: a step with {len(refs)} adapters for {self.max_loras} slots")
        where = {digest: slot for slot, digest in enumerate(self.slots) if digest in refs}
        for digest, ref in refs.items():
            if digest in where:
                continue
            by_layer = self._load(ref)
            slot = next(s for s in self._slot_use if s not in where.values())  # least recently used first
            for path, layer in self.layers.items():
                modules = by_layer.get(path)
                if modules:
                    layer.set_slot(slot, modules)
                elif self.slots[slot] is not None:
                    layer.clear_slot(slot)
            self.slots[slot] = digest
            where[digest] = slot
        for slot in where.values():
            self._slot_use.move_to_end(slot)
        return where

    def begin_step(self, adapters: Sequence[AdapterRef | None], query_lens: Sequence[int]) -> None:
        """Plan a step whose request i (rows in order, ``query_lens[i]`` each) runs with ``adapters[i]``."""
        refs = {ref.digest: ref for ref in adapters if ref is not None}
        if not refs:
            self.end_step()
            return
        where = self._activate(refs)
        slots = [where[ref.digest] if ref is not None else -1 for ref in adapters]
        context = self.context
        if context.kernel is None:
            context.plan = plan_step(slots, query_lens, self.rank_width, self.device)
            return
        rows = torch.tensor(slots, dtype=torch.int32).repeat_interleave(torch.tensor(query_lens))
        if rows.numel() > context.row_slots.numel():
            raise RuntimeError(f"LoRA: a step of {rows.numel()} rows for {context.row_slots.numel()} row slots")
        context.row_slots[:rows.numel()] = rows
        self._rows_set = rows.numel()
        context.active = True

    def end_step(self) -> None:
        context = self.context
        context.plan = None
        context.active = False
        if self._rows_set:
            context.row_slots[:self._rows_set] = -1  # padded rows of a replayed graph must read -1
            self._rows_set = 0


def _full_shape(layer: Linear, shard: int | None) -> tuple[int, int]:
    """(out, in) of ``layer``'s shard ``shard`` (None: the whole layer) in the checkpoint, before any tensor-parallel
    split."""
    parts = getattr(layer, "shard_parts", None)
    if parts is not None:  # column-parallel: this rank holds rows of each shard
        rows = parts[shard].full if shard is not None else sum(p.full for p in parts)
    else:
        rows = layer.shard_sizes[shard] if shard is not None else layer.out_features
    part = getattr(layer, "input_part", None)  # row-parallel: this rank holds columns
    return rows, part.full if part is not None else layer.in_features


def rank_part(layer: Linear, shard: int | None, module: LoRAModule) -> LoRAModule:
    """This tensor-parallel rank's piece of ``module``, split like the layer it sits beside: a column-parallel
    layer's rows of B (per shard), a row-parallel layer's columns of A (each rank's partial term is summed by the
    layer's all-reduce, ``x_r A_r^T B^T`` over r being ``x A^T B^T``); the module itself on one rank."""
    parts = getattr(layer, "shard_parts", None)
    if parts is not None:
        if shard is not None:
            rows = [(parts[shard].start, parts[shard].size)]
        else:  # the fused matrix whole (Phi-3): each shard's rows of this rank, shard after shard
            offsets = [sum(p.full for p in parts[:i]) for i in range(len(parts))]
            rows = [(offset + p.start, p.size) for offset, p in zip(offsets, parts)]
        b = torch.cat([module.b[start:start + size] for start, size in rows])
        return LoRAModule(module.a, b.contiguous())
    part = getattr(layer, "input_part", None)
    if part is not None:
        return LoRAModule(module.a[:, part.start:part.start + part.size].contiguous(), module.b)
    return module
