"""``--distributed-executor-backend ray``: tensor-parallel ranks 1..T-1 as Ray actors in a placement group (one
bundle per rank, ``PACK``; ``{"CPU": k}`` bundles on CPU machines, GPU bundles on GPU ones). Rank 0 stays in the
engine's process, as with ``mp``; the step broadcast and the rendezvous go over TCP to this node's address, so
the ranks may sit on other nodes of the cluster."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.multiproc_executor import MultiprocExecutor, free_tcp_port, threads_per_rank
from pagedllm.executor.ray_utils import (
    ActorCall,
    ProcessActor,
    bundles_for,
    ensure_ray,
    node_ip,
    placement_group,
    strategy,
)
from pagedllm.logger import init_logger

logger = init_logger(__name__)


class RayExecutor(MultiprocExecutor):
    """``MultiprocExecutor`` with its ranks 1..T-1 in Ray actors of a placement group, reached over TCP."""

    backend_name = "ray"

    def __init__(self, config: EngineConfig, rank_target: Callable[..., None] | None = None) -> None:
        from pagedllm.platforms import platform_for
        from pagedllm.worker.worker import resolve_device

        world = config.parallel.tensor_parallel_size
        self._cpus = threads_per_rank(world)
        self._use_gpus = platform_for(resolve_device(config.device.device)).is_accelerator
        self.ray = ensure_ray(config.parallel.ray_address, world * self._cpus)
        self.pg = placement_group(bundles_for(world, self._cpus, self._use_gpus))
        logger.info("ray: placement group of %d bundles (%s each, PACK) for the tensor-parallel ranks", world,
                    bundles_for(1, self._cpus, self._use_gpus)[0])
        self._ip = node_ip()
        super().__init__(config, rank_target)

    def _addresses(self) -> tuple[str, str, str]:
        return (f"tcp://0.0.0.0:{free_tcp_port()}", f"tcp://0.0.0.0:{free_tcp_port()}",
                f"tcp://{self._ip}:{free_tcp_port()}")

    def _connect_addresses(self, step_address: str, answer_address: str) -> tuple[str, str]:
        return (step_address.replace("0.0.0.0", self._ip), answer_address.replace("0.0.0.0", self._ip))

    def _start_rank(self, target: Callable[..., None], config: EngineConfig, rank: int, init_method: str,
                    step_address: str, answer_address: str, threads: int) -> Any:
        options: dict[str, Any] = {"num_cpus": 1 if self._use_gpus else self._cpus,
                                   "scheduling_strategy": strategy(self.pg, rank)}
        if self._use_gpus:
            options["num_gpus"] = 1
        actor = self.ray.remote(ProcessActor).options(name=None, **options).remote()
        pid = self.ray.get(actor.pid.remote())
        ref = actor.run.remote(target, config, rank, init_method, step_address, answer_address, None, threads)
        return ActorCall(actor, ref, pid, f"tensor-parallel rank {rank}")

    def _release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        remove_placement_group(self.pg)
