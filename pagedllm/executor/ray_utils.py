"""Ray, for the ``ray`` executor and ``--data-parallel-backend ray``: joining a cluster (or starting a local one),
placement groups over CPU or GPU bundles, and a process-like handle on an actor that runs a long call.

vLLM refuses Ray without GPUs; here a CPU machine gets ``{"CPU": k}`` bundles (k = the threads of one rank or
engine), a GPU machine ``{"GPU": 1, "CPU": 1}`` bundles.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedllm.logger import init_logger

logger = init_logger(__name__)


def ray_module() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError("the ray backends need Ray: pip install 'pagedllm[ray]'") from e
    return ray


def ensure_ray(address: str | None, num_cpus_wanted: int) -> Any:
    """Join the cluster at ``address`` (the flag, else RAY_ADDRESS), or start a local Ray with enough CPUs."""
    from pagedllm import envs
    from pagedllm.utils import physical_cpu_cores

    ray = ray_module()
    if ray.is_initialized():
        return ray
    address = address or envs.RAY_ADDRESS
    start = time.perf_counter()
    if address:
        ray.init(address=address, log_to_driver=False)
        logger.info("ray: joined the cluster at %s in %.1f s (%s)", address, time.perf_counter() - start,
                    ray.cluster_resources())
    else:
        # Logical CPUs: the bundles below reserve them; the threads themselves are set per rank.
        num_cpus = max(physical_cpu_cores(), num_cpus_wanted)
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        logger.info("ray: started a local instance (%d CPUs) in %.1f s", num_cpus, time.perf_counter() - start)
    return ray


def bundles_for(num: int, cpus_each: int, use_gpus: bool) -> list[dict[str, float]]:
    """One bundle per rank or engine: ``{"GPU": 1, "CPU": 1}`` on GPU machines, ``{"CPU": k}`` on CPU ones."""
    return [{"GPU": 1.0, "CPU": 1.0} if use_gpus else {"CPU": float(cpus_each)} for _ in range(num)]


def placement_group(bundles: list[dict[str, float]], timeout_s: float = 120.0) -> Any:
    """A ``PACK`` placement group (ranks close together: the all-reduces are the hot path), ready or ValueError
    naming what the cluster lacks."""
    ray = ray_module()
    from ray.util.placement_group import placement_group as make

    pg = make(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ValueError(f"ray: the cluster cannot place {len(bundles)} bundles of {bundles[0]} within "
                         f"{timeout_s:.0f} s (it has {ray.available_resources()})")
    return pg


def strategy(pg: Any, bundle_index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index)


class PlacementGroupRelease:
    """Removes a placement group once ``users`` calls placed in it have ended."""

    def __init__(self, pg: Any, users: int) -> None:
        self.pg, self.left = pg, users
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.left -= 1
            if self.left:
                return
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception as e:  # noqa: BLE001 - Ray already shut down: nothing left to release
            logger.debug("ray: placement group not removed (%s)", e)


def node_ip() -> str:
    """This node's address as the cluster sees it (what actors on other nodes connect to)."""
    return ray_module().util.get_node_ip_address()


class ProcessActor:
    """A Ray actor that runs one process-like life in one call (``run``): an engine core (``ray_engines.py``) or
    a tensor-parallel rank (``ray_executor.py``); ``ActorCall`` watches that call as it would a process."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, target: Callable[..., None], *args: Any) -> None:
        target(*args)


class ActorCall:
    """A long-running call on an actor, seen like a ``multiprocessing.Process`` by the code that watches engines
    and ranks: ``sentinel`` becomes readable when the call ends, ``exitcode`` is then 0 (returned) or 1
    (raised, or the actor died)."""

    def __init__(self, actor: Any, ref: Any, pid: int, name: str, on_end: Any = None) -> None:
        self.actor, self.ref, self.pid, self.name = actor, ref, pid, name
        self.on_end = on_end  # called once the call ended (the last engine's releases the placement group)
        self.exitcode: int | None = None
        self._r, self._w = os.pipe()
        self.sentinel = self._r
        threading.Thread(target=self._wait, name=f"pagedllm-ray-{name}", daemon=True).start()

    def _wait(self) -> None:
        ray = ray_module()
        try:
            ray.get(self.ref)
            self.exitcode = 0
        except BaseException as e:  # noqa: BLE001 - the actor raised or died: report, never propagate
            logger.warning("ray: %s ended: %s", self.name, str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.exitcode = 1
        os.write(self._w, b"x")
        if self.on_end is not None:
            self.on_end()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def terminate(self) -> None:
        ray_module().kill(self.actor, no_restart=True)

    kill = terminate
