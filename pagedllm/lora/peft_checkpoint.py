"""Read and check a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``, as ``peft`` saves it).

An adapter is refused at load, with the reason, whenever pagedllm could not apply it exactly: DoRA, LoRA on the
embedding or the LM head, trained bias terms or extra saved modules, a rank above ``--max-lora-rank``, a target
module the base model does not have, or A / B shapes that do not fit that module. What loads is one
``LoRAModule`` per target: A [r, in] and B [out, r] with the scaling (``lora_alpha / r``, or ``lora_alpha /
sqrt(r)`` for rsLoRA) folded into B, float32 on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT saves a LoRA model's tensors under this prefix (its wrapper's ``base_model.model``).
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)\.weight$")
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head", "wte", "word_embeddings")


@dataclass(frozen=True)
class LoRAModule:
    """One target module's low-rank pair: ``a`` [r, in], ``b`` [out, r] (scaling already folded into ``b``)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    """A checked adapter: its modules by base-model module path (``model.layers.0.self_attn.q_proj``)."""

    path: str
    digest: str
    modules: dict[str, LoRAModule]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def adapter_files(path: str) -> tuple[str, str]:
    """(config file, weights file) of a PEFT folder; ValueError naming what is missing."""
    if not path or not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a folder (a PEFT adapter folder holds {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE})")
    config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for f in (config_file, weights_file):
        if not os.path.isfile(f):
            hint = " (.bin adapters: save them again with safe_serialization=True)" if f == weights_file else ""
            raise ValueError(f"lora_path: {path!r} has no {os.path.basename(f)}{hint}")
    return config_file, weights_file


def adapter_digest(path: str) -> str:
    """sha256 (hex, 32 characters) of the adapter's config and weights bytes: what identifies its content."""
    h = hashlib.sha256()
    for f in adapter_files(path):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(len(chunk).to_bytes(8, "little"))
                h.update(chunk)
        h.update(b"|")
    return h.hexdigest()[:32]


def read_adapter_config(path: str) -> dict:
    """The adapter's ``adapter_config.json``, checked for what pagedllm cannot apply (ValueError saying why)."""
    config_file, _ = adapter_files(path)
    try:
        with open(config_file) as fh:
            config = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: {config_file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path: {config_file} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"lora_path: {path!r} is a {peft_type} adapter; only LoRA adapters can be served")
    if config.get("use_dora"):
        raise ValueError(f"lora_path: {path!r} is a DoRA adapter (use_dora); DoRA's magnitude vectors are not "
                         "supported: merge it into the base model instead")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"lora_path: {path!r} sets fan_in_fan_out (GPT-2 Conv1D layers), which is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"lora_path: {path!r} trains bias terms (bias={config.get('bias')!r}); only adapters "
                         "with bias='none' are supported")
    if config.get("modules_to_save"):
        raise ValueError(f"lora_path: {path!r} saves whole modules ({config['modules_to_save']}); only the "
                         "low-rank terms of an adapter can be applied")
    return config


def load_peft_adapter(path: str, base_shapes: dict[str, tuple[int, int]], max_lora_rank: int,
                      digest: str | None = None) -> PeftAdapter:
    """Read, check and scale the adapter at ``path``.

    ``base_shapes``: (out, in) of every module LoRA may target in the base model, by module path
    (``target_modules.base_module_shapes``). ValueError, naming the adapter and the reason, for anything that
    cannot be applied exactly.
    """
    from safetensors.torch import load_file

    config = read_adapter_config(path)
    _, weights_file = adapter_files(path)
    try:
        tensors = load_file(weights_file)
    except Exception as e:  # safetensors raises its own error types for a corrupt file
        raise ValueError(f"lora_path: {weights_file} could not be read ({e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if "lora_magnitude_vector" in name:
            raise ValueError(f"lora_path: {path!r} holds DoRA magnitude vectors ({key}); DoRA is not supported")
        if "lora_embedding" in name or any(f".{t}." in f".{name}" for t in _UNSUPPORTED_TARGETS):
            raise ValueError(f"lora_path: {path!r} has LoRA on the embedding or the LM head ({key}); only the "
                             "attention and MLP projections can carry an adapter")
        match = _LORA_KEY.match(name)
        if match is None:
            raise ValueError(f"lora_path: {path!r} holds {key!r}, which is not a LoRA A or B weight")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise ValueError(f"lora_path: {path!r} holds no LoRA weights")
    modules = {}
    for module, ab in sorted(pairs.items()):
        modules[module] = _check_module(path, module, ab, config, base_shapes, max_lora_rank)
    return PeftAdapter(path, digest or adapter_digest(path), modules)


def _check_module(path: str, module: str, ab: dict[str, torch.Tensor], config: dict,
                  base_shapes: dict[str, tuple[int, int]], max_lora_rank: int) -> LoRAModule:
    if set(ab) != {"A", "B"}:
        raise ValueError(f"lora_path: {path!r} module {module} has lora_{next(iter(ab))} but no pair for it")
    if module not in base_shapes:
        raise ValueError(f"lora_path: {path!r} targets {module}, which the base model does not have (or which "
                         "cannot carry LoRA); was the adapter trained for another model?")
    a, b = ab["A"], ab["B"]
    out_features, in_features = base_shapes[module]
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
        raise ValueError(f"lora_path: {path!r} module {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                         f"fit the base model's [{out_features}, {in_features}] weight; was the adapter trained "
                         "for another model?")
    if rank > max_lora_rank:
        raise ValueError(f"lora_path: {path!r} module {module} has rank {rank}, above --max-lora-rank "
                         f"{max_lora_rank}; start the server with a larger --max-lora-rank")
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAModule(a.to(torch.float32).contiguous(), (b.to(torch.float32) * scaling).contiguous())


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's per-module override (``alpha_pattern``): a key matches a module path's tail, or as a regex."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default
