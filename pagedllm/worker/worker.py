"""One worker: picks the device, loads the model, sizes and allocates the KV cache, runs steps."""

from __future__ import annotations

import os

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.logger import init_logger
from pagedllm.utils import format_bytes
from pagedllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device: must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def _set_cpu_threads() -> None:
    # One thread per physical core; more only adds contention on small matmuls.
    if "OMP_NUM_THREADS" not in os.environ:
        try:
            import psutil
            cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        except ImportError:
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores))


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.model_executor.loader import load_model
        from pagedllm.model_executor.loader.dtype import torch_dtype

        self.config = config
        self.device = resolve_device(config.device.device)
        config.device.device = self.device.type
        if self.device.type == "cpu":
            _set_cpu_threads()
            # Build/load the C++ kernels now, so a fresh machine compiles them during start-up (logged)
            # and not inside the first request, after the server already reported healthy.
            load_cpu_kernels()
        mc = config.model
        self.dtype = torch_dtype(mc.dtype)
        torch.manual_seed(mc.seed)
        model = load_model(mc, self.device)
        self.runner = ModelRunner(model, self.device, self.dtype, config.cache.block_size, mc.vocab_size,
                                  mc.eos_token_ids)
        if config.speculative is not None:
            from pagedllm.spec_decode.setup import attach_spec_decoder

            attach_spec_decoder(self.runner, config.speculative, self.device)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        per_block = self.runner.bytes_per_block()
        num_blocks = cache.kv_cache_memory // per_block
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory: {format_bytes(cache.kv_cache_memory)} holds no KV block "
                f"(one block needs {format_bytes(per_block)}); raise --kv-cache-memory")
        return int(num_blocks)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)
        cache = self.config.cache
        tokens = (num_blocks - 1) * cache.block_size
        max_len = self.config.scheduler.max_model_len
        size = format_bytes(num_blocks * self.runner.bytes_per_block())
        logger.info("KV cache: %d blocks of %d tokens (%s, %s), %d tokens; max concurrency %.1fx at %d tokens "
                    "per request", num_blocks, cache.block_size, size, self.config.model.dtype, tokens,
                    tokens / max_len, max_len)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)
