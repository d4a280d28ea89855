"""GPTQ and AWQ checkpoints (``quantization_config`` in config.json), read into the kernels' 4-bit layouts.

Formats, as published by AutoGPTQ and AutoAWQ (the "GEMM" layout), with q, z unsigned ``bits``-bit ints,
``pf = 32 // bits`` values per int32, G = K / group_size groups:
- GPTQ: ``qweight`` int32 [K / pf, N] packs along the inputs (value j of word r is input r * pf + j,
  at bit bits * j); ``qzeros`` int32 [G, N / pf] packs along the outputs and stores z - 1;
  ``scales`` f16 [G, N]; ``g_idx`` int32 [K] is the group of each input (not k // group_size when the
  checkpoint was made with act-order, ``desc_act``). w[n, k] = scales[g, n] * (q[k, n] - z[g, n]).
- AWQ: ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [G, N / 8] pack along the outputs in the order
  0, 2, 4, 6, 1, 3, 5, 7 (nibble i of word c holds output 8c + order[i]); z is stored as is; ``scales`` f16
  [G, N]; 4-bit only. w[n, k] = scales[g, n] * (q[n, k] - z[g, n]).
4-bit weights map exactly onto q4 panels (min = -scale * z); symmetric 8-bit GPTQ maps onto q8 panels
(q - 128). Anything else (act-order, asymmetric 8-bit) is dequantized and re-quantized to int8 per channel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.quantization.base import (
    LinearMethod,
    PackedLinearMethod,
    QuantizationConfig,
    set_weight_loader,
)
from pagedllm.model_executor.layers.quantization.layouts import layout_for
from pagedllm.model_executor.layers.quantization.qpanels import quantize_q8
from pagedllm.model_executor.layers.quantization.registry import register_quantization_config
from pagedllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod

logger = init_logger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int32 [R * pf, C]: value j of word [r, c] becomes row r * pf + j."""
    pf = 32 // bits
    shifts = torch.arange(pf, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(1) >> shifts.view(1, pf, 1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * pf, packed.shape[1])


def unpack_along_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * pf]: value i of word [r, c] is column c * pf + order[i] (default i)."""
    pf = 32 // bits
    shifts = torch.arange(pf, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, pf] in packing order
    if order is not None:
        vals = vals[..., torch.argsort(torch.tensor(order))]
    return vals.reshape(packed.shape[0], packed.shape[1] * pf)


class _PackedCheckpointMethod(PackedLinearMethod):
    """Collects a layer's packed tensors per shard as loaded; subclasses turn one shard into (q, z, s)."""

    tensor_names: tuple[str, ...] = ()

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits = bits
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.ckpt_parts = {}
        layer.qpanels = None
        layer.ckpt_scheme = self.name
        for tname in self.tensor_names:
            # Placeholders: the checkpoint tensors are kept per shard until every one has arrived.
            param = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
            setattr(layer, tname, set_weight_loader(
                param, lambda p, w, shard_id=None, t=tname: layer.ckpt_parts.__setitem__((t, shard_id or 0), w)))

    def checkpoint_axes(self, name: str, loaded: torch.Tensor) -> tuple[int | None, int | None]:
        """(output axis, input axis) of a checkpoint tensor, for tensor parallelism: the packed tensors are
        [inputs (or groups), outputs]; ``g_idx`` [K] runs along the inputs."""
        return (None, 0) if loaded.ndim == 1 else (1, 0)

    def shard_qzs(self, layer: nn.Module, parts: dict[str, torch.Tensor], rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One shard -> (q [rows, K] int32, z [rows, G] int32, s [rows, G] float32, g_idx [K] or None)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.qpanels is not None:
            return
        shards = []
        for shard, rows in enumerate(layer.shard_sizes):
            parts = {t: layer.ckpt_parts.get((t, shard)) for t in self.tensor_names}
            missing = [t for t, v in parts.items() if v is None and t != "g_idx"]
            if missing:
                raise ValueError(f"{layer.prefix or 'linear'}: shard {shard} lacks {', '.join(missing)}")
            shards.append(self.shard_qzs(layer, parts, rows))
        group = layer.in_features // shards[0][2].shape[1]
        in_order = torch.arange(layer.in_features) // group
        trivial_groups = all(g is None or torch.equal(g.long(), in_order) for *_, g in shards)
        if not trivial_groups:
            # Act-order: give every input its own group's zero and scale; re-quantized below.
            shards = [(q, z[:, (in_order if g is None else g.long())], s[:, (in_order if g is None else g.long())],
                       None) for q, z, s, g in shards]
        qs, zs, ss = ([sh[i] for sh in shards] for i in range(3))
        q, z, s = torch.cat(qs), torch.cat(zs), torch.cat(ss)
        # The checkpoint's tensors arrive on the CPU; the packed weight lives with the layer (a CUDA layer packs
        # rows for the Triton kernel, qrows.py), as its placeholder parameters do.
        placeholder = getattr(layer, self.tensor_names[0])
        layout = layout_for(placeholder)

        def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
            return [t.to(placeholder.device) for t in tensors]

        if trivial_groups and self.bits == 4:
            layer.qpanels = layout.pack_q4(*on_device(q.to(torch.uint8), s, -s * z.float()))
        elif trivial_groups and self.bits == 8 and bool((z == 128).all()):
            layer.qpanels = layout.pack_q8(*on_device((q - 128).to(torch.int8), s))
        else:
            group = layer.in_features // s.shape[1]
            w = (q.float() - z.float().repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)
            layer.qpanels = layout.pack_q8(*on_device(*quantize_q8(w, layer.in_features)))
            layer.ckpt_scheme = f"{self.name} -> int8 per-channel"
        layer.ckpt_parts = {}
        for tname in self.tensor_names:
            setattr(layer, tname, None)

    def scheme(self, layer: nn.Module) -> str:
        return layer.ckpt_scheme

    def _group(self, layer: nn.Module) -> int:
        return layer.in_features if self.group_size <= 0 else self.group_size


class GPTQLinearMethod(_PackedCheckpointMethod):
    tensor_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int) -> None:
        super().__init__(bits, group_size)
        self.name = f"gptq {bits}-bit g{group_size}"

    def shard_qzs(self, layer: nn.Module, parts: dict[str, torch.Tensor], rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = layer.in_features
        groups = k // self._group(layer)
        q = unpack_along_rows(parts["qweight"].to(torch.int32), self.bits)  # [K, rows]
        z = unpack_along_cols(parts["qzeros"].to(torch.int32), self.bits) + 1  # stored as z - 1
        s = parts["scales"].float()
        _check(layer, "qweight", tuple(q.shape), (k, rows))
        _check(layer, "qzeros", tuple(z.shape), (groups, rows))
        _check(layer, "scales", tuple(s.shape), (groups, rows))
        g_idx = parts.get("g_idx")
        if g_idx is not None:
            # A tensor-parallel rank holding input columns k0.. sees groups from k0 / group: number them from 0.
            g_idx = g_idx.long() - g_idx.long().min()
            if int(g_idx.max()) >= groups:
                raise ValueError(f"{layer.prefix or 'linear'}: an act-order (desc_act) GPTQ layer cannot be split "
                                 "by input columns across tensor-parallel ranks")
        return q.t().contiguous(), z.t().contiguous(), s.t().contiguous(), g_idx


class AWQLinearMethod(_PackedCheckpointMethod):
    tensor_names = ("qweight", "qzeros", "scales")

    def __init__(self, bits: int, group_size: int) -> None:
        super().__init__(bits, group_size)
        self.name = f"awq {bits}-bit g{group_size}"

    def shard_qzs(self, layer: nn.Module, parts: dict[str, torch.Tensor], rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = layer.in_features
        groups = k // self._group(layer)
        q = unpack_along_cols(parts["qweight"].to(torch.int32), self.bits, AWQ_ORDER)  # [K, rows]
        z = unpack_along_cols(parts["qzeros"].to(torch.int32), self.bits, AWQ_ORDER)
        s = parts["scales"].float()
        _check(layer, "qweight", tuple(q.shape), (k, rows))
        _check(layer, "qzeros", tuple(z.shape), (groups, rows))
        _check(layer, "scales", tuple(s.shape), (groups, rows))
        return q.t().contiguous(), z.t().contiguous(), s.t().contiguous(), None


def _check(layer: nn.Module, name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise ValueError(f"{layer.prefix or 'linear'}.{name}: unpacked shape {got}, expected {expected}")


class _CheckpointConfig(QuantizationConfig):
    """A scheme only a checkpoint's config.json names: ``--quantization`` with its name cannot quantize."""

    reads_checkpoints = True

    @classmethod
    def from_flag(cls, method: str, gguf_file: str | None = None) -> QuantizationConfig:
        raise ValueError(f"quantization {method!r} reads checkpoints whose config.json has a "
                         "quantization_config of that method; this model has none")


@register_quantization_config("gptq")
class GPTQConfig(_CheckpointConfig):
    """config.json ``quantization_config`` with ``quant_method: gptq`` (bits 4 or 8)."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool = False, sym: bool = True) -> None:
        if bits not in (4, 8):
            raise ValueError(f"quantization gptq: {bits}-bit weights are not supported (4 or 8)")
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GPTQConfig:
        return cls(int(cfg.get("bits", 4)), int(cfg.get("group_size", 128)), bool(cfg.get("desc_act", False)),
                   bool(cfg.get("sym", True)))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        if prefix.endswith("lm_head"):
            return UnquantizedLinearMethod()  # GPTQ checkpoints keep the head in float
        return GPTQLinearMethod(self.bits, self.group_size)


@register_quantization_config("awq")
class AWQConfig(_CheckpointConfig):
    """config.json ``quantization_config`` with ``quant_method: awq`` (4-bit, GEMM layout)."""

    name = "awq"

    def __init__(self, bits: int, group_size: int) -> None:
        if bits != 4:
            raise ValueError(f"quantization awq: {bits}-bit weights are not supported (4 only)")
        self.bits, self.group_size = bits, group_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> AWQConfig:
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization awq: layout {version!r} is not supported (only 'gemm')")
        return cls(int(cfg.get("bits", cfg.get("w_bit", 4))), int(cfg.get("group_size", cfg.get("q_group_size", 128))))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        if prefix.endswith("lm_head"):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(self.bits, self.group_size)
