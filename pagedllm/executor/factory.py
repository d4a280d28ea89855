"""``make_executor``, the one place that chooses how an engine core runs its model, and the checks of that
choice (the backend name, what tensor parallelism can split) made before any process starts."""

from __future__ import annotations

from dataclasses import replace

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor
from pagedllm.logger import init_logger

logger = init_logger(__name__)

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def resolve_executor_backend(tensor_parallel_size: int, backend: str | None) -> str:
    """vLLM's default: ``uni`` for one rank, ``mp`` for several; ValueError for a name or a pairing that cannot run."""
    if backend is None:
        return "uni" if tensor_parallel_size == 1 else "mp"
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend: must be one of {', '.join(EXECUTOR_BACKENDS)}, got "
                         f"{backend!r}")
    if backend == "uni" and tensor_parallel_size > 1:
        raise ValueError(f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size is "
                         f"{tensor_parallel_size} (use mp or ray)")
    return backend


def check_tensor_parallel(config: EngineConfig) -> None:
    """Fail before any process starts when the ranks cannot get distinct processors or a mode cannot be split."""
    from pagedllm.platforms import platform_for
    from pagedllm.worker.worker import resolve_device

    world = config.parallel.tensor_parallel_size
    if world == 1:
        return
    platform = platform_for(resolve_device(config.device.device))
    limit = platform.max_tensor_parallel_size()
    if config.parallel.distributed_executor_backend != "ray" and world > limit:
        unit = "GPUs" if platform.is_accelerator else "physical CPU cores"
        raise ValueError(f"tensor_parallel_size {world} is more than this host's {limit} {unit}")
    if config.model.is_pooling:
        raise ValueError("tensor_parallel_size > 1: pooling (embedding) models run on one rank")
    if config.model.is_encoder_decoder:
        raise ValueError(f"tensor_parallel_size > 1: {config.model.architecture} (encoder-decoder) runs on one rank")
    if config.speculative is not None and config.speculative.method == "draft_model":
        raise ValueError("tensor_parallel_size > 1: speculative method 'draft_model' is not split across ranks; "
                         "use ngram or layer_skip")


def eager_across_ranks(config: EngineConfig) -> EngineConfig:
    """``config``, or a copy with ``enforce_eager`` on when several ranks run on a platform that records graphs
    (CUDA graphs are not captured across ranks). Decided here, in the engine's process, where the device is."""
    from pagedllm.platforms import platform_for
    from pagedllm.worker.worker import resolve_device

    if config.parallel.tensor_parallel_size == 1 or config.device.enforce_eager:
        return config
    if not platform_for(resolve_device(config.device.device)).supports_graphs:
        return config
    logger.info("tensor parallel: decode steps run eagerly (CUDA graphs are not captured across ranks)")
    return replace(config, device=replace(config.device, enforce_eager=True))


def make_executor(config: EngineConfig) -> Executor:
    """The engine core's executor: a ``UniprocExecutor`` (uni), ``MultiprocExecutor`` (mp) or ``RayExecutor`` (ray),
    built from ``config`` with the changes tensor parallelism needs (``eager_across_ranks``)."""
    backend = config.parallel.distributed_executor_backend
    check_tensor_parallel(config)
    config = eager_across_ranks(config)
    if backend == "mp":
        from pagedllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from pagedllm.executor.uniproc_executor import UniprocExecutor

    return UniprocExecutor(config)
