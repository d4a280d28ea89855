"""``--data-parallel-backend ray``: the data-parallel engine cores as Ray actors, placed by a placement group over
the cluster (one bundle per engine), speaking the engine-process messages unchanged over TCP
(``engine/core_messages.py``). ``--data-parallel-size`` counts engines on all nodes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from pagedllm.config import EngineConfig
from pagedllm.executor.ray_utils import (
    ActorCall,
    PlacementGroupRelease,
    ProcessActor,
    bundles_for,
    ensure_ray,
    node_ip,
    placement_group,
    strategy,
)
from pagedllm.logger import init_logger

logger = init_logger(__name__)


def bind_tcp(sock: zmq.Socket) -> str:
    """Bind ``sock`` on every interface at a free port; the address engines on other nodes connect to."""
    port = sock.bind_to_random_port("tcp://0.0.0.0")
    return f"tcp://{node_ip()}:{port}"


def start_ray_engines(config: EngineConfig, num_engines: int, target: Callable[..., None], input_address: str,
                      output_address: str, threads_per_engine: int | None) -> list[ActorCall]:
    """Start ``num_engines`` engine-core actors, one per bundle of a PACK placement group; returns their handles
    (process-like: ``sentinel``, ``exitcode``, ``pid``), which the client watches as it watches processes."""
    from pagedllm.platforms import platform_for
    from pagedllm.worker.worker import resolve_device

    tp = config.parallel.tensor_parallel_size
    cpus = max(1, threads_per_engine or 1)
    use_gpus = platform_for(resolve_device(config.device.device)).is_accelerator
    ray = ensure_ray(config.parallel.ray_address, num_engines * cpus * tp)
    # An engine's tensor-parallel ranks (mp) run beside it: its bundle holds their CPUs or GPUs too.
    bundle = {k: v * tp for k, v in bundles_for(1, cpus, use_gpus)[0].items()}
    pg = placement_group([dict(bundle) for _ in range(num_engines)])
    logger.info("ray: %d engine-core actors, one bundle each (%s, PACK)", num_engines, bundle)
    handles = []
    release = PlacementGroupRelease(pg, num_engines)
    for index in range(num_engines):
        options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 1), "scheduling_strategy": strategy(pg, index)}
        if use_gpus:
            options["num_gpus"] = bundle["GPU"]
        actor = ray.remote(ProcessActor).options(**options).remote()
        pid = ray.get(actor.pid.remote())
        ref = actor.run.remote(target, config, index, input_address, output_address, None, threads_per_engine)
        handles.append(ActorCall(actor, ref, pid, f"engine {index}", on_end=release))
    return handles
