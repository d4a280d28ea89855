"""Per-layer k/v scales of an fp8 KV cache (``Attention.kv_scale``, [2] float32: k_scale, v_scale).

An fp8 cache stores K / k_scale and V / v_scale (``attention/backends/paged_kv``). The scales come, in this order
of precedence, from --calculate-kv-scales (the first step's K/V: max |K| / 200 and max |V| / 100, the constants
vLLM uses, which leave e4m3's range headroom for later tokens), from the checkpoint (tensors named like vLLM's:
``...self_attn.k_scale`` / ``v_scale``, also under ``.attn.`` or ``.k_proj.`` / ``.v_proj.``), or 1.0."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

K_SCALE_DIVISOR = 200.0
V_SCALE_DIVISOR = 100.0

# <layer's attention module prefix>.[attn.|k_proj.|v_proj.]k_scale / v_scale
_SCALE_NAME = re.compile(r"^(?P<prefix>.*?)\.(?:attn\.|k_proj\.|v_proj\.)?(?P<which>[kv])_scale$")


def calculate_kv_scale_(kv_scale: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``kv_scale`` [2] in place from one step's K/V ([T, Hkv*D] or [T, Hkv, D]); a zero tensor keeps 1.0."""
    for i, (t, divisor) in enumerate(((key, K_SCALE_DIVISOR), (value, V_SCALE_DIVISOR))):
        amax = float(t.detach().abs().max()) if t.numel() else 0.0
        kv_scale[i] = amax / divisor if 0 < amax < math.inf else 1.0  # NaN and inf keep 1.0 too


def kv_scale_target(name: str) -> tuple[str, int] | None:
    """(module prefix of the layer's attention block, 0 for k / 1 for v) of a checkpoint's scale tensor, else None."""
    m = _SCALE_NAME.match(name)
    if m is None:
        return None
    return m.group("prefix"), 0 if m.group("which") == "k" else 1


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Set the k or v scale of the attention layer under ``name``'s prefix from a checkpoint tensor (a scalar, or
    one per head: the largest, as a per-tensor scale must cover every head). False: ``name`` is no KV scale or
    no attention layer lies under its prefix. ValueError for a scale that is not positive and finite."""
    target = kv_scale_target(name)
    if target is None:
        return False
    prefix, which = target
    try:
        owner = model.get_submodule(prefix)
    except AttributeError:
        return False
    layer = next((m for m in owner.modules() if _has_kv_scale(m)), None)
    if layer is None:
        return False
    value = float(tensor.detach().float().max())
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be positive and finite, got {value}")
    layer.kv_scale[which] = value
    layer.kv_scales_from_checkpoint = True
    return True


def set_calculate_kv_scales(model: nn.Module) -> None:
    """Ask every cached attention layer of ``model`` to set its scales from the K/V of its next forward."""
    for layer in model.modules():
        if _has_kv_scale(layer) and layer.spec.uses_kv_cache:
            layer.calculate_kv_scales = True


def layer_kv_scales(model: nn.Module) -> list[list[float]]:
    """[k scale, v scale] of each cached attention layer of ``model``, in ``layer_idx`` order."""
    layers = [m for m in model.modules() if _has_kv_scale(m) and m.spec.uses_kv_cache]
    return [layer.kv_scale.tolist() for layer in sorted(layers, key=lambda m: m.layer_idx)]


def _has_kv_scale(module: nn.Module) -> bool:
    """An attention layer (``layers.attention.Attention``, which imports this module: known by its fields)."""
    return isinstance(getattr(module, "kv_scale", None), torch.Tensor) and hasattr(module, "calculate_kv_scales")
