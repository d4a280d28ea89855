"""Which runner a model gets, and how a pooling model pools: read from its sentence-transformers files.

A sentence-transformers folder lists its modules in ``modules.json`` (Transformer -> Pooling -> Normalize);
the Pooling module's ``config.json`` names the method (``pooling_mode_mean_tokens`` ...), and
``sentence_bert_config.json`` the longest input it was trained on. Explicit ``PoolerConfig`` fields win.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.config import RUNNERS, PoolerConfig
from pagedllm.logger import init_logger

logger = init_logger(__name__)

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# 1_Pooling/config.json flag -> our pooling type.
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
             "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sentence_transformers_modules(folder: str | None) -> list[dict] | None:
    """The folder's ``modules.json`` entries, or None when it is not a sentence-transformers model."""
    if not folder:
        return None
    modules = _read_json(os.path.join(folder, "modules.json"))
    return modules if isinstance(modules, list) else None


def resolve_runner(runner: str, is_encoder_only: bool, folder: str | None, architecture: str) -> str:
    """"auto" -> "pooling" for encoder-only architectures and sentence-transformers folders, else "generate"."""
    if runner not in RUNNERS:
        raise ValueError(f"runner: must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner == "auto":
        runner = "pooling" if is_encoder_only or sentence_transformers_modules(folder) else "generate"
    if runner == "generate" and is_encoder_only:
        raise ValueError(f"runner: {architecture} is an encoder-only (embedding) model and cannot generate "
                         "text; use --runner pooling")
    return runner


def _st_pooling(folder: str, modules: list[dict]) -> tuple[str | None, bool]:
    """(pooling type or None, normalize) from the sentence-transformers module list."""
    pooling_type = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            cfg = _read_json(os.path.join(folder, module.get("path", ""), "config.json")) or {}
            on = [flag for flag in (*_ST_MODES, *_ST_UNSUPPORTED) if cfg.get(flag)]
            if len(on) != 1 or on[0] not in _ST_MODES:
                raise ValueError(f"model: sentence-transformers pooling {on or 'none'} is not supported "
                                 f"(one of {', '.join(_ST_MODES)})")
            pooling_type = _ST_MODES[on[0]]
        elif kind.endswith(".Normalize"):
            normalize = True
    return pooling_type, normalize


def resolve_pooler_config(folder: str | None, hf_config: Any, default_pooling_type: str,
                          overrides: PoolerConfig | None) -> PoolerConfig:
    """A complete ``PoolerConfig``: explicit overrides, else the sentence-transformers files, else the
    architecture's default pooling with normalisation (as embedding models are used)."""
    overrides = overrides or PoolerConfig()
    modules = sentence_transformers_modules(folder)
    st_type, st_normalize = _st_pooling(folder, modules) if modules else (None, True)
    pooling_type = (overrides.pooling_type or st_type or default_pooling_type).upper()
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                         f"got {overrides.pooling_type!r}")
    normalize = st_normalize if overrides.normalize is None else bool(overrides.normalize)
    matryoshka = overrides.enable_matryoshka
    if matryoshka is None:
        matryoshka = bool(getattr(hf_config, "is_matryoshka", False)
                          or getattr(hf_config, "matryoshka_dimensions", None))
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, enable_matryoshka=matryoshka)


def sentence_transformers_max_len(folder: str | None) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json``: inputs the model was trained on (ST truncates there)."""
    if not folder:
        return None
    cfg = _read_json(os.path.join(folder, "sentence_bert_config.json")) or {}
    value = cfg.get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None
