"""One weight loader for every model, driven by a per-model ``WeightMapping``.

A checkpoint name is renamed, maybe transposed, then routed either to a parameter of the same name or,
for a stacked projection (q/k/v, gate/up), to a fused parameter plus the shard's index. The parameter's
own ``weight_loader(param, tensor, shard_id)`` does the copy when it has one (quantized layers), else
``default_weight_loader``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.kv_cache_scales import load_kv_scale
from pagedllm.model_executor.layers.rotary_embedding import partial_rotary_factor, partial_rotary_order
from pagedllm.model_executor.models.blocks import head_dim_of


@dataclass(frozen=True)
class WeightMapping:
    """How checkpoint names reach parameters.

    ``stacked``: (checkpoint fragment, fused parameter fragment, shard index), e.g. ("q_proj", "qkv_proj", 0).
    ``renames``: (old, new) substrings applied first (GPT-2's ``attn.c_attn`` -> ``attn.qkv_proj``).
    ``skip``: substrings of checkpoint names that hold nothing to load (rotary tables, causal-mask buffers).
    ``transposed``: fragments whose ``.weight`` is stored [in, out] (GPT-2's Conv1D), transposed on load.
    ``experts``: (checkpoint fragment, stacked parameter, row shard) for a MoE's per-expert tensors:
    ``...experts.{e}.{fragment}.weight`` fills ``...experts.{parameter}`` with shard id ``(e, row shard)``.
    """

    stacked: tuple[tuple[str, str, int], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()
    transposed: tuple[str, ...] = ()
    experts: tuple[tuple[str, str, int], ...] = ()


# q/k/v and gate/up stored apart (Llama, Qwen, Mistral, Gemma); our layers fuse them.
STACKED_QKV_GATE_UP = (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
                       ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


# Per-expert tensors of a MoE checkpoint: Mixtral's w1 / w3 / w2 and everyone else's gate / up / down.
STACKED_EXPERTS = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1), ("down_proj", "down_proj", 0),
                   ("w1", "gate_up_proj", 0), ("w3", "gate_up_proj", 1), ("w2", "down_proj", 0))
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv|weight_scale|input_scale)$")
# An expert tensor's suffix -> the stacked parameter's (an fp8 checkpoint's scales beside its weights).
_EXPERT_SUFFIX = {"weight": "", "weight_scale_inv": "_scale_inv", "weight_scale": "_scale",
                  "input_scale": "_input_scale"}


def _expert_target(name: str, mapping: WeightMapping) -> tuple[str, tuple[int, int]] | None:
    """(stacked parameter name, (expert, row shard)) for a per-expert checkpoint tensor, else None."""
    m = _EXPERT_NAME.search(name) if mapping.experts else None
    if m is None:
        return None
    for fragment, param, shard in mapping.experts:
        if m.group(2) == fragment:
            return f"{name[:m.start()]}.experts.{param}{_EXPERT_SUFFIX[m.group(3)]}", (int(m.group(1)), shard)
    return None


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None,
                          shard_sizes: tuple[int, ...] | None = None) -> None:
    """Copy a whole tensor, or shard ``shard_id`` into its row range of a fused parameter (rows split by
    ``shard_sizes`` along dim 0). ValueError on a shape mismatch."""
    dest = param.data
    if shard_id is not None:
        if not shard_sizes:
            raise ValueError(f"shard {shard_id} given for a parameter that is not fused")
        dest = dest.narrow(0, sum(shard_sizes[:shard_id]), shard_sizes[shard_id])
    if dest.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint {tuple(loaded_weight.shape)}, model {tuple(dest.shape)}")
    dest.copy_(loaded_weight)


def _shard_count(model: nn.Module, param_name: str) -> int:
    owner = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    if hasattr(owner, "num_loaded_shards"):  # stacked experts: one shard per (expert, row shard)
        return owner.num_loaded_shards(param_name.rsplit(".", 1)[-1])
    return len(getattr(owner, "shard_sizes", None) or ()) or 1


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], mapping: WeightMapping,
                 skip_names: Iterable[str] = ()) -> set[str]:
    """Load (checkpoint name, tensor) pairs into ``model``; returns the parameter names filled.

    ValueError for a name with no parameter, a shape mismatch, or a parameter the checkpoint never filled.
    ``skip_names``: exact checkpoint names to ignore (a tied ``lm_head.weight``).
    """
    params = dict(model.named_parameters())
    skip_exact = set(skip_names)
    shards_seen: dict[str, set[int | None]] = {}
    for name, tensor in weights:
        if name in skip_exact or any(s in name for s in mapping.skip):
            continue
        for old, new in mapping.renames:
            name = name.replace(old, new)
        if name.endswith(("k_scale", "v_scale")) and load_kv_scale(model, name, tensor):
            continue  # an fp8 KV cache's per-layer scale (kv_cache_scales)
        # Raw quantized blocks (GGUF) are always stored [out, in]: only float checkpoint tensors transpose.
        if isinstance(tensor, torch.Tensor) and name.endswith(".weight") and any(f".{t}." in name
                                                                                for t in mapping.transposed):
            tensor = tensor.t()
        target, shard_id = name, None
        expert = _expert_target(name, mapping)
        if expert is not None:
            target, shard_id = expert
        for ckpt, fused, sid in () if expert is not None else mapping.stacked:
            if f".{ckpt}." in name:
                target, shard_id = name.replace(f".{ckpt}.", f".{fused}."), sid
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} does not match any parameter of {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is not None:
                loader(param, tensor, shard_id)
            else:
                owner = model.get_submodule(target.rsplit(".", 1)[0]) if "." in target else model
                default_weight_loader(param, tensor, shard_id, getattr(owner, "shard_sizes", None))
        except ValueError as e:
            raise ValueError(f"shape mismatch for {name!r}: {e}") from e
        shards_seen.setdefault(target, set()).add(shard_id)
    loaded = {n for n, seen in shards_seen.items() if len(seen) >= (_shard_count(model, n) if None not in seen else 1)}
    missing = sorted(set(params) - loaded)
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(f"weights missing from the checkpoint: {missing[:8]}{more}")
    return loaded


def beyond_the_decoder(name: str, num_layers: int) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a multi-token-prediction module stored as decoder layers past
    the last (DeepSeek-V3's and GLM-4.5's ``num_nextn_predict_layers``), which decoding here does not use."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


# A head's dims in a checkpoint: q/k projection rows (and biases) and q/k norm weights.
_HEAD_DIMS = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


def partial_rotary_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                              cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A partial-rotary family's checkpoint as the full-width rotary kernels want it: each head's dims of q_proj /
    k_proj (weights [heads * D, ...], biases [heads * D]) and of the q/k norm weights (one head's [D], or all heads'
    [heads * D]) reordered by ``partial_rotary_order``; a multi-token-prediction layer past the decoder's left
    out."""
    head_dim = head_dim_of(cfg)
    order = partial_rotary_order(head_dim, int(head_dim * partial_rotary_factor(cfg)))
    for name, tensor in weights:
        if beyond_the_decoder(name, cfg.num_hidden_layers):
            continue
        if any(f in name for f in _HEAD_DIMS):
            tensor = tensor.reshape(-1, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)
        yield name, tensor
