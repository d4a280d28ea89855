"""Tensor-parallel linear layers and the vocab-parallel embedding, built on the layers' own weight loaders.

A parallel layer is an ordinary ``Linear`` of this rank's size whose parameters' ``weight_loader`` first cuts the
checkpoint tensor to this rank's slice, then hands it to the quantization method's loader: every scheme shards
without knowing it (float, int8 / int4 / w8a8 / fp8 quantized at load, GGUF blocks kept quantized, GPTQ / AWQ
packed words). Checkpoint tensors are [out, in] (a method whose tensors are laid out otherwise says so with
``checkpoint_axes``); a GGUF matrix is cut on whole blocks.

- column-parallel (q/k/v, gate/up, the LM head): rank r holds rows of each shard; KV heads fewer than the ranks
  are replicated (rank r reads KV head ``r * num_kv_heads // world_size``), as vLLM does.
- row-parallel (o, down): rank r holds a column slice; the outputs are summed by an all-reduce; the bias is
  added by rank 0 only (zeros elsewhere), so the sum carries it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp
from pagedllm.model_executor.layers.kernel_binding import KernelBinding
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization.base import set_weight_loader


@dataclass(frozen=True)
class Slice:
    """Rows [start, start + size) of a dimension whose whole size is ``full``."""

    start: int
    size: int
    full: int


def _axes(layer: Linear, name: str, loaded: Any) -> tuple[int | None, int | None]:
    """(output axis, input axis) of checkpoint tensor ``loaded`` for parameter ``name`` (None: no such axis)."""
    custom = getattr(layer.quant_method, "checkpoint_axes", None)
    if custom is not None:
        return custom(name, loaded)
    ndim = getattr(loaded, "ndim", 2)
    return (0, 1) if ndim >= 2 else (0, None)


def narrow_loaded(layer: Linear, name: str, loaded: Any, axis_kind: str, part: Slice) -> Any:
    """This rank's ``part`` of ``loaded`` along its output ("out") or input ("in") axis.

    A packed axis (GPTQ's 8 values per int32, a block-scale's one per 128 inputs) is cut in the same
    proportion; a size-1 axis (a per-tensor scale) is broadcast, not cut.
    """
    from pagedllm.model_executor.layers.quantization.gguf import GGUFQuantTensor

    if isinstance(loaded, GGUFQuantTensor):
        return _narrow_gguf(layer, loaded, axis_kind, part)
    out_axis, in_axis = _axes(layer, name, loaded)
    axis = out_axis if axis_kind == "out" else in_axis
    if axis is None or axis >= loaded.ndim:
        return loaded
    size = loaded.shape[axis]
    if size == part.full:
        if part.start + part.size > size:  # the last rank of a padded vocabulary: zero rows past its end
            kept = loaded.narrow(axis, part.start, size - part.start)
            pad = [0, 0] * (loaded.ndim - 1 - axis) + [0, part.start + part.size - size]
            return F.pad(kept, pad)
        return loaded.narrow(axis, part.start, part.size)
    if size == 1:
        return loaded
    factor = part.full // size if size and part.full % size == 0 else 0
    if not factor or part.start % factor or part.size % factor:
        raise ValueError(f"tensor parallel: {layer.prefix} {name} has {size} entries along its {axis_kind}put axis "
                         f"for {part.full} {axis_kind}puts; rank slice {part.start}:{part.start + part.size} does "
                         "not fall on its packing")
    return loaded.narrow(axis, part.start // factor, part.size // factor)


def _narrow_gguf(layer: Linear, t: Any, axis_kind: str, part: Slice) -> Any:
    from gguf import GGML_QUANT_SIZES

    from pagedllm.model_executor.layers.quantization.gguf import GGUFQuantTensor

    rows, k = t.shape
    if axis_kind == "out":
        raw = t.raw[part.start:part.start + part.size]
        if raw.shape[0] < part.size:  # padded vocabulary rows: all-zero blocks decode to zero weights
            raw = F.pad(raw, (0, 0, 0, part.size - raw.shape[0]))
        return GGUFQuantTensor(raw, t.ggml_type, (part.size, k))
    block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
    if part.start % block or part.size % block:
        raise ValueError(f"tensor parallel: {layer.prefix} is GGUF {t.type_name} (blocks of {block} inputs); its "
                         f"{k} inputs split in {part.size} per rank do not fall on whole blocks")
    lo, n = part.start // block * block_bytes, part.size // block * block_bytes
    return GGUFQuantTensor(t.raw[:, lo:lo + n].contiguous(), t.ggml_type, (rows, part.size))


def column_parallel_linear(input_size: int, shard_parts: Sequence[Slice], *, bias: bool, dtype: torch.dtype,
                           quant_config: Any = None, prefix: str = "") -> Linear:
    """A column-parallel ``Linear``: shard i of the fused layer holds rows ``shard_parts[i]`` of checkpoint shard i.

    A checkpoint that stores the fused matrix whole (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``) is split by the
    shards' full sizes first.
    """
    sizes = tuple(p.size for p in shard_parts)
    layer = Linear(input_size, sum(sizes), bias=bias, dtype=dtype, quant_config=quant_config,
                   shard_sizes=sizes if len(sizes) > 1 else None, prefix=prefix)
    layer.shard_parts = tuple(shard_parts)  # what a LoRA term beside it cuts its B rows by (lora/model_manager.py)
    for name, param in list(layer.named_parameters(recurse=False)):
        inner = getattr(param, "weight_loader", None)
        if inner is None:
            continue

        def load(p: nn.Parameter, w: Any, shard_id: int | None = None, inner=inner, name=name) -> None:
            if shard_id is None and len(shard_parts) > 1:  # the whole fused matrix: one shard after another
                start = 0
                for sid, part in enumerate(shard_parts):
                    whole = Slice(start, part.full, sum(s.full for s in shard_parts))
                    shard = narrow_loaded(layer, name, w, "out", whole)
                    inner(p, narrow_loaded(layer, name, shard, "out", part), sid)
                    start += part.full
                return
            part = shard_parts[shard_id or 0]
            inner(p, narrow_loaded(layer, name, w, "out", part), shard_id)

        set_weight_loader(param, load)
    return layer


class RowParallelLinear(Linear):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's input columns; the partial sums joined by an all-reduce."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return all_reduce(super().forward(x, out))

    def forward_activation(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        return None  # the activation follows the sum, not each rank's part


def row_parallel_linear(part: Slice, output_size: int, *, bias: bool, dtype: torch.dtype, quant_config: Any = None,
                        prefix: str = "") -> RowParallelLinear:
    """A row-parallel layer over input columns ``part`` of the checkpoint's ``part.full`` inputs."""
    layer = RowParallelLinear(part.size, output_size, bias=bias, dtype=dtype, quant_config=quant_config,
                              prefix=prefix)
    layer.input_part = part  # what a LoRA term beside it cuts its A columns by (lora/model_manager.py)
    rank = get_tp().rank
    for name, param in list(layer.named_parameters(recurse=False)):
        inner = getattr(param, "weight_loader", None)
        if inner is None:
            continue

        def load(p: nn.Parameter, w: Any, shard_id: int | None = None, inner=inner, name=name) -> None:
            if name == "bias":
                if rank == 0:
                    inner(p, w, shard_id)
                else:  # zeros: the all-reduce adds rank 0's bias once
                    p.data.zero_()
                return
            whole_rows = getattr(layer.quant_method, "load_input_slice", None)
            if name == "weight" and whole_rows is not None and isinstance(w, torch.Tensor) and \
                    whole_rows(layer, w, part, shard_id):
                return  # quantized with the whole row's scale, then cut: the same codes as on one rank
            inner(p, narrow_loaded(layer, name, w, "in", part), shard_id)

        set_weight_loader(param, load)
    return layer


def even_part(full: int, what: str) -> Slice:
    """This rank's even share of ``full`` (ValueError naming ``what`` when it does not divide)."""
    from pagedllm.distributed.parallel_state import divide

    tp = get_tp()
    size = divide(full, tp.world_size, what)
    return Slice(tp.rank * size, size, full)


def padded_vocab_part(vocab_size: int) -> Slice:
    """This rank's rows of a vocabulary padded up to a multiple of the ranks (the last rank's tail is padding)."""
    tp = get_tp()
    per_rank = -(-vocab_size // tp.world_size)
    return Slice(tp.rank * per_rank, per_rank, vocab_size)


def _rows_padded(w: torch.Tensor, part: Slice) -> torch.Tensor:
    """Rows ``part`` of ``w`` [V, ...], zero rows past the vocabulary's end."""
    rows = w[part.start:min(part.start + part.size, w.shape[0])]
    if rows.shape[0] < part.size:
        rows = F.pad(rows, (0, 0, 0, part.size - rows.shape[0]))
    return rows


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rank holds rows ``part`` of the vocabulary: ids outside it look up zeros, and an
    all-reduce sums the ranks' rows (each id is found on exactly one rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.part = padded_vocab_part(vocab_size)
        super().__init__(self.part.size, hidden_size, dtype=dtype)
        self.vocab_size = vocab_size
        set_weight_loader(self.weight, lambda p, w, shard_id=None: p.data.copy_(_rows_padded(w, self.part)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lo, hi = self.part.start, self.part.start + self.part.size
        outside = (input_ids < lo) | (input_ids >= hi)
        local = (input_ids - lo).masked_fill(outside, 0)
        x = F.embedding(local, self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(x)


class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` whose row lookup of a flat batch is the C++ kernel where the platform has it: the same
    rows, and a CPU step graph can record it (worker/cpu_graphs.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Keyed by the table's device and dtype, the lookup's own.
        self._kernels = KernelBinding(lambda platform, dtype: platform.cpu_kernels_family(dtype, (torch.float32,
                                                                                                   torch.bfloat16)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int64 -> [T, hidden_size]."""
        kernels = self._kernels(self.weight)
        if kernels is not None and input_ids.dim() == 1 and input_ids.dtype == torch.long:
            return kernels.embedding_rows(self.weight, input_ids)
        return super().forward(input_ids)


def make_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Embedding:
    """The token embedding: vocab-parallel under tensor parallelism, else a ``TokenEmbedding``."""
    if get_tp().is_parallel:
        return VocabParallelEmbedding(vocab_size, hidden_size, dtype)
    return TokenEmbedding(vocab_size, hidden_size, dtype=dtype)


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-sharded logits [N, V_r] on each rank -> [N, vocab_size] on every rank (padding columns cut)."""
    if not get_tp().is_parallel:
        return logits
    return all_gather_last_dim(logits)[:, :vocab_size]
