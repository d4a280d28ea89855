"""One worker: picks the device, loads the model, sizes and allocates the KV cache, runs steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from pagedllm.attention.backends.paged_kv import is_fp8
from pagedllm.attention.backends.registry import get_attention_backend
from pagedllm.config import EngineConfig, KVCacheLayout
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.attention import attention_layers
from pagedllm.model_executor.layers.kv_cache_scales import layer_kv_scales, set_calculate_kv_scales
from pagedllm.platforms import platform_for
from pagedllm.utils import cdiv, format_bytes
from pagedllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

CPU_DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3  # without --kv-cache-memory on a CPU


def kv_format(model: torch.nn.Module, kv_dtype: torch.dtype) -> str:
    """What a KV cache's bytes mean, for the two ends of a transfer to compare: its dtype and, for an 8-bit
    cache, each layer's k/v scales and whether its keys are stored rotated (``Attention.key_rotation``)."""
    name = str(kv_dtype).removeprefix("torch.")
    if not is_fp8(kv_dtype):
        return name
    rotated = ["R" if layer.key_rotation is not None else "-" for layer in attention_layers(model)
               if layer.spec.uses_kv_cache]
    return name + ":" + ",".join(f"{k:.8g}/{v:.8g}" for k, v in layer_kv_scales(model)) + ":" + "".join(rotated)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if platform_for("cuda").is_available() else "cpu")
    if name == "cuda" and not platform_for("cuda").is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device: must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


class Worker:
    """``tp_rank`` / ``tp_init_method``: this worker's rank in a tensor-parallel group of
    ``config.parallel.tensor_parallel_size`` (joined before the model is built, so its layers are this rank's
    slices; ``executor/``). ``tp_alive``: rank 0's check, called while it waits for the others to join, that
    raises when one of them has exited.

    Start-up: ``determine_kv_cache_layout`` finds what this worker can hold, ``init_kv_cache`` allocates the
    layout the executor settled on; from then on ``config`` is the given config resolved with that layout."""

    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_init_method: str | None = None,
                 tp_alive: Callable[[], None] | None = None) -> None:
        from pagedllm.distributed.parallel_state import get_tp, init_tensor_parallel
        from pagedllm.model_executor.loader import load_model
        from pagedllm.model_executor.loader.dtype import kv_cache_torch_dtype, torch_dtype

        self.config = config
        self.kv_connector = None  # a KV connector's worker half (attach_kv_connector), else None
        self.device = resolve_device(config.device.device)
        self.platform = platform_for(self.device)  # every device-specific choice of this engine comes from it
        self.platform.prepare_worker()
        world = config.parallel.tensor_parallel_size
        if world > 1:
            self.device = self.platform.rank_device(self.device, tp_rank)
            self.tp = init_tensor_parallel(tp_rank, world, tp_init_method, self.platform.distributed_backend,
                                           alive=tp_alive, expert_parallel=config.parallel.enable_expert_parallel)
        else:
            self.tp = get_tp()
        mc = config.model
        self.dtype = torch_dtype(mc.dtype)
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype)
        if self.kv_dtype not in self.platform.kv_cache_dtypes(self.dtype):
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.platform.kv_cache_dtypes(self.dtype))
            raise ValueError(f"kv_cache_dtype: {config.cache.kv_cache_dtype} is not available for a {mc.dtype} "
                             f"model on {self.platform.name}; use auto or one of {allowed}")
        torch.manual_seed(mc.seed)
        model = load_model(mc, self.device)
        self.attention_backend = get_attention_backend(self.platform, config.device.attention_backend)
        self._bind_attention_backend(model)
        logger.info("attention backend: %s", self.attention_backend.name)
        pooling = None
        if mc.is_pooling:
            from pagedllm.model_executor.layers.pooler import Pooler
            from pagedllm.worker.pooling_runner import PoolingRunner, log_pooling_setup

            log_pooling_setup(mc)
            pooling = PoolingRunner(Pooler(mc.pooler_config.pooling_type, bool(mc.pooler_config.normalize)),
                                    mc.is_encoder_only)
        self.runner = ModelRunner(model, self.device, self.dtype, config.cache.block_size, mc.vocab_size,
                                  mc.eos_token_ids, pooling=pooling, kv_dtype=self.kv_dtype)
        # The windows the model's attention layers decide (part of the KV cache layout).
        self.sliding_window = self.runner.kv_sliding_window()
        self.sliding_group_window = self.runner.kv_cache_groups()[1]
        if is_fp8(self.kv_dtype) and (self.sliding_window is not None or self.sliding_group_window is not None
                                      or mc.is_encoder_decoder
                                      or any(m.sinks is not None for m in attention_layers(model))):
            raise ValueError(f"kv_cache_dtype: an fp8 KV cache serves models whose cached layers are all causal "
                             f"full attention without sinks; {mc.architecture} has sliding-window, cross-attention "
                             f"or sink layers")
        if mc.is_encoder_decoder:
            from pagedllm.sample.whisper_rules import WhisperDecodingRules, WhisperRulesStage
            from pagedllm.worker.encoder_decoder import attach_encoder_decoder

            attach_encoder_decoder(self.runner, config.cache.cross_group_tokens)
            rules = WhisperDecodingRules.from_config(mc.hf_config, mc.vocab_size)
            self.runner.add_model_rules_stage(WhisperRulesStage(rules))
        if config.lora is not None:
            from pagedllm.lora.model_manager import LoRAModelManager, choose_lora_kernel

            if mc.is_pooling or mc.is_encoder_decoder:
                raise ValueError("enable_lora: LoRA adapters are served on decoder (generate) models only")
            kernel, in_graphs = choose_lora_kernel(
                self.platform.cpu_kernels(self.dtype, (torch.float32, torch.bfloat16)), self.device)
            spec_tokens = config.speculative.num_speculative_tokens if config.speculative is not None else 0
            max_rows = max(config.scheduler.max_num_batched_tokens, 16 * (1 + spec_tokens))  # steps and graphs
            self.runner.lora = LoRAModelManager(model, mc.hf_config, config.lora.max_loras, config.lora.cpu_loras,
                                                config.lora.max_lora_rank, self.device, kernel, max_rows,
                                                self.dtype, kernel_in_graphs=in_graphs)
        if config.speculative is not None:
            from pagedllm.spec_decode.setup import attach_spec_decoder

            attach_spec_decoder(self.runner, config.speculative, self.device)
            if getattr(self.runner, "draft_model", None) is not None:
                self._bind_attention_backend(self.runner.draft_model)  # the draft attends as the target does

    def close_parallel(self) -> None:
        """Leave the tensor-parallel group (nothing for a single rank)."""
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        if self.tp.is_parallel:
            destroy_tensor_parallel()

    def _bind_attention_backend(self, model: torch.nn.Module) -> None:
        """The engine's one attention backend on every attention layer of ``model`` (chosen once, not per call)."""
        for layer in attention_layers(model):
            layer.backend = self.attention_backend

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        """The KV cache this worker can hold: its blocks per group from the memory budget, the windows, the device."""
        layout = KVCacheLayout(num_blocks=2, device=self.platform.name, sliding_window=self.sliding_window,
                               sliding_group_window=self.sliding_group_window)
        if self.config.model.is_encoder_only:
            return layout  # an encoder keeps no KV cache; the block pool's minimum (null block + one)
        num_blocks, sliding_blocks, cross_blocks = self._kv_cache_blocks()
        return replace(layout, num_blocks=num_blocks, sliding_group_num_blocks=sliding_blocks,
                       cross_group_num_blocks=cross_blocks)

    def _kv_cache_blocks(self) -> tuple[int, int, int]:
        """(blocks of the main group, of a hybrid model's sliding group, of the cross-attention group)."""
        cache = self.config.cache
        per_block = self.runner.bytes_per_block()
        if cache.kv_cache_memory is not None:
            budget, flag = cache.kv_cache_memory, "kv_cache_memory"
        elif self.platform.is_accelerator and not self.config.model.is_encoder_decoder:
            budget, flag = self._profile_gpu_kv_budget(), "gpu_memory_utilization"
        else:
            budget, flag = CPU_DEFAULT_KV_CACHE_MEMORY, "kv_cache_memory"
        if self.sliding_group_window is not None:
            return (*self._split_hybrid_budget(budget, flag), 0)
        if cache.cross_group_tokens:
            decoder, cross = self._split_cross_budget(budget, flag)
            return decoder, 0, cross
        num_blocks = budget // per_block
        if num_blocks < 2:
            raise ValueError(
                f"{flag}: {format_bytes(budget)} for the KV cache holds no KV block "
                f"(one block needs {format_bytes(per_block)}); raise --{flag.replace('_', '-')}")
        return int(num_blocks), 0, 0

    def _split_hybrid_budget(self, budget: int, flag: str) -> tuple[int, int]:
        """A hybrid model: size the sliding group for its window (worker/kv_cache_groups.py), give the full
        group the rest; returns (the full group's blocks, the sliding group's)."""
        from pagedllm.worker.kv_cache_groups import sliding_group_blocks_wanted, split_kv_budget

        cache, sched = self.config.cache, self.config.scheduler
        wanted = sliding_group_blocks_wanted(self.sliding_group_window, cache.block_size,
                                             sched.max_num_batched_tokens, sched.max_num_seqs,
                                             sched.num_lookahead_tokens)
        full, sliding = split_kv_budget(budget, self.runner.bytes_per_block(0), self.runner.bytes_per_block(1),
                                        wanted)
        if full < 2:
            raise ValueError(
                f"{flag}: {format_bytes(budget)} for the KV cache holds no KV block "
                f"(one block needs {format_bytes(self.runner.bytes_per_block())}); raise --{flag.replace('_', '-')}")
        return full, sliding

    def _split_cross_budget(self, budget: int, flag: str) -> tuple[int, int]:
        """An encoder-decoder model: split the budget so both groups hold the same number of requests at full
        length (the decoder's max_model_len, the encoder's positions); returns (the decoder group's blocks, the
        cross group's)."""
        cache, bs = self.config.cache, self.config.cache.block_size
        decoder_blocks = cdiv(self.config.scheduler.max_model_len, bs)
        cross_blocks = cdiv(cache.cross_group_tokens, bs)
        per_request = decoder_blocks * self.runner.bytes_per_block(0) + cross_blocks * self.runner.bytes_per_block(1)
        requests = budget // per_request
        if requests < 1:
            raise ValueError(f"{flag}: {format_bytes(budget)} for the KV cache cannot hold one request of "
                             f"{self.config.model.architecture} ({format_bytes(per_request)}: "
                             f"{cache.cross_group_tokens} encoder positions and "
                             f"{self.config.scheduler.max_model_len} decoder tokens); raise "
                             f"--{flag.replace('_', '-')}")
        return int(requests * decoder_blocks + 1), int(requests * cross_blocks + 1)

    def _profile_gpu_kv_budget(self) -> int:
        """Run the largest step the scheduler can issue (the whole token budget in prompts of at most
        max_model_len tokens, then the sampler's costliest stages on max_num_seqs rows) on a throw-away KV
        cache, and size the real cache from what is left."""
        import gc

        from pagedllm.worker.gpu_memory import gpu_kv_cache_budget
        from pagedllm.worker.profile_step import profile_query_lens, run_profile_step

        sched, bs = self.config.scheduler, self.config.cache.block_size
        query_lens = profile_query_lens(sched.max_num_batched_tokens, sched.max_model_len, sched.max_num_seqs)
        # Loading may leave freed blocks in the caching allocator: hand them back first, or they would count
        # as "in use" below although the allocator would reuse them.
        gc.collect()
        self.platform.empty_cache()
        self.platform.synchronize(self.device)
        free, total = self.platform.mem_get_info(self.device)
        used_before = total - free
        self.platform.reset_peak_memory_stats(self.device)
        allocated_before = self.platform.memory_allocated(self.device)
        run_profile_step(self.runner, query_lens, bs, sched.max_num_seqs)
        self.platform.synchronize(self.device)
        peak = self.platform.max_memory_allocated(self.device) - allocated_before
        self.platform.empty_cache()
        budget = gpu_kv_cache_budget(total, used_before, peak, self.config.cache.gpu_memory_utilization)
        logger.info("GPU memory: %s in use before profiling, largest step (%d tokens in %d prompts, %d sampled "
                    "rows) peaks at %s more; KV cache gets %s (--gpu-memory-utilization %g of %s)",
                    format_bytes(used_before), sum(query_lens), len(query_lens),
                    min(sum(query_lens), sched.max_num_seqs), format_bytes(peak), format_bytes(budget),
                    self.config.cache.gpu_memory_utilization, format_bytes(total))
        return budget

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV cache of ``layout`` (the executor's choice: every rank's smallest) and record the
        decode graphs that need it."""
        self.config = self.config.with_kv_cache_layout(layout)
        num_blocks = layout.num_blocks
        if self.config.model.is_encoder_only:
            logger.info("no KV cache: %s is an encoder; each prompt runs whole in one step (up to %d tokens "
                        "per step)", self.config.model.architecture, self.config.scheduler.max_num_batched_tokens)
            return
        cache = self.config.cache
        start = time.perf_counter()
        self.runner.init_kv_cache(num_blocks, cache.sliding_group_num_blocks or cache.cross_group_num_blocks,
                                  prefault=cache.kv_cache_prefault)
        elapsed = time.perf_counter() - start
        tokens = (num_blocks - 1) * cache.block_size
        max_len = self.config.scheduler.max_model_len
        group = cache.sliding_group()
        per_block = (self.runner.bytes_per_block() if group is None and cache.cross_group() is None
                     else self.runner.bytes_per_block(0))
        size = format_bytes(num_blocks * per_block)
        logger.info("KV cache: %d blocks of %d tokens (%s, %s), %d tokens; max concurrency %.1fx at %d tokens "
                    "per request", num_blocks, cache.block_size, size, cache.kv_cache_dtype, tokens,
                    tokens / max_len, max_len)
        if self.platform.maps_kv_lazily:
            logger.info("KV cache: %s", f"resident from start-up, written in {elapsed:.2f} s (--no-kv-cache-prefault "
                        "maps pages as blocks are first used)" if cache.kv_cache_prefault else
                        "pages mapped as blocks are first used (--no-kv-cache-prefault)")
        cross = cache.cross_group()
        if cross is not None:
            logger.info("KV cache: the cross-attention layers keep their own %d blocks (%s): %d requests' encoder "
                        "outputs (%d positions each); the blocks above are the decoder's self-attention layers'",
                        cross[0], format_bytes(cross[0] * self.runner.bytes_per_block(1)),
                        (cross[0] - 1) // cdiv(cross[1], cache.block_size), cross[1])
        if group is not None:
            logger.info("KV cache: the sliding-window layers (window %d) keep their own %d blocks (%s), sized for "
                        "%d requests at the window plus one step's tokens; the blocks above are the full-attention "
                        "layers'", group[1], group[0], format_bytes(group[0] * self.runner.bytes_per_block(1)),
                        self.config.scheduler.max_num_seqs)
        self.capture_decode_graphs()
        if is_fp8(self.kv_dtype):
            self._start_kv_scales()  # after the capture: its warm-up forwards must not set the scales

    def _start_kv_scales(self) -> None:
        """An fp8 cache: log where the layers' k/v scales come from; with --calculate-kv-scales, ask the layers to
        set them from their first forward (the first real step, a prompt's: the decode graphs captured above read
        the scale tensors at each replay)."""
        models = [self.runner.model, *([d] if (d := getattr(self.runner, "draft_model", None)) is not None else [])]
        cached = [m for m in attention_layers(self.runner.model) if m.spec.uses_kv_cache]
        rotated = sum(m.key_rotation is not None for m in cached)
        logger.info("KV cache: fp8 keys stored in a rotated basis in %d of %d layers%s", rotated, len(cached),
                    "" if rotated == len(cached) else " (the others' scales are the checkpoint's, calibrated on "
                    "unrotated keys)")
        if self.config.cache.calculate_kv_scales:
            for model in models:
                set_calculate_kv_scales(model)
            logger.info("KV cache: fp8 scales of each layer set from the first step's K/V (--calculate-kv-scales)")
            return
        scales = layer_kv_scales(self.runner.model)
        loaded = sum(s != [1.0, 1.0] for s in scales)
        logger.info("KV cache: fp8 scales %s", f"from the checkpoint for {loaded} of {len(scales)} layers (k_scale "
                    f"{min(s[0] for s in scales):.4g}-{max(s[0] for s in scales):.4g})" if loaded else
                    "1.0 (the checkpoint ships no k_scale/v_scale; --calculate-kv-scales sets them from the first "
                    "step)")

    def capture_decode_graphs(self) -> None:
        """After the KV cache exists: record decode steps for a ladder of batch sizes, as CUDA graphs on a GPU
        (with triton, whose kernels make a step graph-safe) or as CPU step graphs over the C++ kernels. Skipped
        with --enforce-eager and for models whose steps are not plain decoder forwards."""
        if self.config.device.enforce_eager or self.runner.pooling is not None:
            return  # a pooling model's steps run through the pooling runner, never a decode graph
        if getattr(self.runner, "encoder_decoder", None) is not None:
            return  # the cross-attention group's metadata is built per step, outside the recorded graphs
        if getattr(self.runner.model, "model_impl", "pagedllm") == "transformers":
            logger.info("%s runs through the transformers fallback: decode steps run eagerly (no %s graphs; "
                        "transformers' layers are Python and torch ops that are not recorded)",
                        self.config.model.architecture, "CUDA" if self.platform.supports_graphs else "CPU step")
            return
        lora = getattr(self.runner, "lora", None)
        if self.platform.supports_graphs:
            if lora is not None:  # recorded with no adapter in the step: the graphs hold the base model only
                logger.info("LoRA: steps with an adapter run eagerly (a CUDA graph does not hold the adapters' "
                            "terms); base-model decode steps replay graphs")
            _capture_cuda_graphs(self)
        elif self.platform.step_graph_kernels(self.dtype) is not None:
            if lora is None:
                _capture_cpu_graphs(self)
                return
            if not lora.graphs_hold_adapters:
                logger.info("LoRA: steps with an adapter run eagerly (no C++ LoRA kernel to record); base-model "
                            "decode steps replay graphs")
            with lora.recording_graphs():  # the kernel's call (on slot -1 rows) goes in every graph
                _capture_cpu_graphs(self)

    def execute_model(self, sched: SchedulerOutput, overlap: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """One step; ``overlap`` (if any) runs while the device computes it (see ModelRunner.execute_model)."""
        if self.kv_connector is not None:
            from pagedllm.worker.kv_connector_step import run_step_with_connector

            return run_step_with_connector(self.kv_connector, sched, lambda: self.runner.execute_model(sched, overlap))
        return self.runner.execute_model(sched, overlap)

    def attach_kv_connector(self, connector) -> None:
        """A KV connector's worker half (distributed/kv_transfer/): it gets the KV cache and brackets every step."""
        runner = self.runner
        groups, window = runner.kv_cache_groups()
        if len(set(groups)) > 1 or window is not None or runner.kv_sliding_window() is not None:
            raise ValueError("kv_transfer_config: KV transfer supports models with one full-attention KV cache "
                             "group (no sliding window)")
        if getattr(runner, "draft_model", None) is not None:
            raise ValueError("kv_transfer_config: a draft model's KV cache is not transferred; use the ngram "
                             "method or no speculation")
        self.platform.prepare_kv_for_transfer(runner.kv_caches)
        connector.set_kv_format(kv_format(runner.model, runner.kv_caches[0].dtype))
        connector.register_kv_caches(runner.kv_caches)
        self.kv_connector = connector


def _capture_cuda_graphs(self: Worker) -> None:
    """CUDA graphs of decode steps (with triton, whose kernels make a step graph-safe)."""
    from pagedllm.kernels.triton_ops import triton_available
    from pagedllm.worker.cuda_graphs import DecodeGraphRunner, graph_batch_sizes

    if not triton_available():
        logger.warning("triton is not installed: decode steps run eagerly (no CUDA graphs)")
        return
    if not getattr(self.attention_backend, "graph_safe", False):
        logger.info("attention backend %r reads tensors on the host: decode steps run eagerly (no CUDA graphs)",
                    self.attention_backend.name)
        return
    if any(m.sinks is not None for m in attention_layers(self.runner.model)):
        logger.info("attention sinks attend through torch ops that read the host: decode steps run eagerly "
                    "(no CUDA graphs)")
        return
    sched, bs = self.config.scheduler, self.config.cache.block_size
    graphs = DecodeGraphRunner(self.runner.model, self.device, graph_batch_sizes(sched.max_num_seqs),
                               max_blocks_per_seq=-(-sched.max_model_len // bs), block_size=bs,
                               hidden_size=self.config.model.hf_config.hidden_size, dtype=self.dtype,
                               num_kv_groups=1 if self.config.cache.sliding_group() is None else 2)
    graphs.capture()
    self.runner.decode_graphs = graphs


def _capture_cpu_graphs(self: Worker) -> None:
    """CPU step graphs over the C++ kernels, for models whose decode forward is nothing but those kernels."""
    from pagedllm.worker.cpu_graphs import CpuDecodeGraphRunner, StepGraphSet, cpu_graph_sizes, verification_graph_sizes

    why = None
    if self.config.parallel.tensor_parallel_size > 1:
        why = "tensor parallelism (the all-reduces are torch.distributed calls)"
    elif not getattr(self.attention_backend, "records_step_graphs", False):
        why = f"attention backend {self.attention_backend.name!r} (only the C++ kernels record)"
    elif any(m.spec.kind != "causal" for m in attention_layers(self.runner.model)):
        why = "layers that are not plain causal attention (the sliding window's path is torch ops)"
    elif any(m.sinks is not None for m in attention_layers(self.runner.model)):
        why = "attention sinks (their path is torch ops)"
    if why is not None:
        logger.info("CPU step graphs not recorded for %s: decode steps run eagerly", why)
        return
    sched, bs = self.config.scheduler, self.config.cache.block_size

    def runner(query_len: int, sizes: list[int]) -> CpuDecodeGraphRunner:
        return CpuDecodeGraphRunner(self.runner.model, self.platform.step_graph_kernels(self.dtype),
                                    max_blocks_per_seq=-(-sched.max_model_len // bs), block_size=bs,
                                    hidden_size=self.config.model.hf_config.hidden_size, dtype=self.dtype,
                                    sizes=sizes, query_len=query_len)

    decodes = runner(1, cpu_graph_sizes(sched.max_num_seqs))
    if not decodes.capture():
        return
    recorded = [decodes]
    # With speculation, a step verifying k drafts per request runs k + 1 tokens each: one graph set per k
    # (ngram proposes up to k, often fewer). One that is refused leaves those steps eager, the rest recorded.
    spec = self.config.speculative
    for drafts in range(1, spec.num_speculative_tokens + 1) if spec is not None else ():
        sizes = verification_graph_sizes(sched.max_num_seqs, drafts + 1)
        verify = runner(drafts + 1, sizes) if sizes else None
        if verify is not None and verify.capture():
            recorded.append(verify)
    self.runner.decode_graphs = StepGraphSet(recorded)
