"""Build a transformers model for the fallback: on the meta device, storage allocated once, weights from
pagedllm's safetensors reader, then what transformers' own loading does for the rest (non-persistent buffers such
as rotary tables, tied embeddings)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.logger import init_logger
from pagedllm.model_executor.models.transformers_fallback.attention import (
    ATTN_IMPLEMENTATION,
    register_paged_attention,
)
from pagedllm.model_executor.models.transformers_fallback.model import (
    TransformersEncoderModel,
    TransformersForCausalLM,
)

logger = init_logger(__name__)


def build_transformers_model(cls: type, hf_config: Any, architecture: str, dtype: torch.dtype,
                             device: torch.device, weights: Iterable[tuple[str, torch.Tensor]],
                             encoder: bool = False) -> TransformersForCausalLM | TransformersEncoderModel:
    """``cls`` (a transformers causal-LM class, or an encoder's base class with ``encoder``) built for
    ``hf_config`` in ``dtype`` on ``device``, filled with ``weights`` (checkpoint name, tensor), its attention on
    pagedllm's backends."""
    register_paged_attention()
    config = copy.deepcopy(hf_config)  # transformers writes dtype and the attention implementation into it
    with torch.device("meta"):
        hf_model = cls._from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    hf_model = hf_model.to_empty(device=device)
    hf_model.tie_weights()  # to_empty gives each tied parameter its own storage: tie them again
    load_checkpoint(hf_model, weights, architecture, encoder=encoder)
    hf_model.initialize_weights()  # only what the checkpoint did not fill: non-persistent buffers (rotary tables)
    hf_model.eval().requires_grad_(False)
    model = (TransformersEncoderModel if encoder else TransformersForCausalLM)(hf_model, architecture)
    model.build_attention_layers()
    return model


def _ignored(model: nn.Module, name: str) -> bool:
    """Checkpoint tensors transformers itself drops on load (stale rotary tables, causal-mask buffers)."""
    patterns = [r"rotary_emb\.inv_freq", *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    return any(re.search(p, name) for p in patterns)


def checkpoint_renamer(model: nn.Module, architecture: str) -> Callable[[str], str]:
    """Checkpoint name -> parameter name by transformers' own renamings for this model (e.g. GPT-NeoX's saved
    ``embed_out`` is its ``lm_head``). A name that needs one of transformers' tensor conversions (experts fused
    on load, ...) is refused: the fallback copies tensors as they are stored."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def rename(name: str) -> str:
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        for converter in converters:
            if converter.rename_source_key(name)[1] is not None:
                raise ValueError(f"model: {architecture}: checkpoint tensor {name!r} needs transformers' weight "
                                 f"conversion ({type(converter).__name__}), which the fallback does not do")
        return name

    return rename


@torch.no_grad()
def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], architecture: str,
                    encoder: bool = False) -> None:
    """Copy each (name, tensor) into the parameter or persistent buffer of that name (a checkpoint saved from the
    bare decoder gets the ``base_model_prefix``). Marks what it fills as initialized (transformers'
    ``_is_hf_initialized``). ValueError for a shape mismatch or a parameter never filled; a tensor with no home
    is logged and left out, as transformers does.

    ``encoder``: ``model`` is an encoder's base model and the checkpoint may be a task model's (``bert.`` names and
    a masked-LM or classifier head, dropped); transformers' own pooler (unused: pagedllm's pooler pools) may be
    absent from it."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    non_persistent = set(dict(model.named_non_persistent_buffers()) if hasattr(
        model, "named_non_persistent_buffers") else {})
    targets.update((n, b) for n, b in model.named_buffers() if n not in non_persistent)
    prefix = getattr(model, "base_model_prefix", "")
    rename = checkpoint_renamer(model, architecture)
    filled: set[int] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        name = rename(name)
        candidates = (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.") if prefix else name)
        target = next((c for c in candidates if c in targets), None)
        if target is None:
            if not (_ignored(model, name) or (encoder and not name.startswith(tuple(
                    f"{child}." for child, _ in model.named_children())))):
                unexpected.append(name)
            continue
        dest = targets[target]
        if dest.shape != tensor.shape:
            raise ValueError(f"model: {architecture}: shape mismatch for {name!r}: checkpoint "
                             f"{tuple(tensor.shape)}, model {tuple(dest.shape)}")
        dest.copy_(tensor)
        dest._is_hf_initialized = True
        filled.add(id(dest))
    missing = [n for n, p in model.named_parameters() if id(p) not in filled
               and not (encoder and n.startswith("pooler."))]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        hint = f" (the checkpoint also holds tensors no parameter takes: {unexpected[:8]})" if unexpected else ""
        raise ValueError(f"model: {architecture}: weights missing from the checkpoint: {missing[:8]}{more}{hint}")
    if unexpected:  # transformers drops them too (with a warning); every parameter was filled
        logger.warning("%s: %d checkpoint tensors match no parameter of transformers' %s and are not loaded: %s%s",
                       architecture, len(unexpected), type(model).__name__, unexpected[:8],
                       " ..." if len(unexpected) > 8 else "")
