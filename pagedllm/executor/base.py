"""``Executor``: what the engine core runs its model through, however many ranks and processes that takes.

Three kinds (``make_executor`` chooses): ``UniprocExecutor`` (one worker in the engine's process), and
``MultiprocExecutor`` / ``RayExecutor`` (tensor-parallel ranks: rank 0's worker in the engine's process, the
others in spawned processes or Ray actors, fed by the step broadcast). The engine core sees only this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig, KVCacheLayout
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedllm.platforms.interface import Platform
    from pagedllm.worker.worker import Worker


class RankDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot run another step."""

    fatal = True  # the engine core stops instead of retrying the step's requests one by one


class Executor(ABC):
    """Start-up (``determine_kv_cache_layout``, then ``init_kv_cache`` with the layout to allocate), one
    ``execute_model`` per step, ``close`` at the end. ``config`` is the config the workers were built from."""

    config: EngineConfig

    @property
    @abstractmethod
    def driver_worker(self) -> Worker:
        """The worker in this process (the only one, or tensor-parallel rank 0's): its runner, model, device."""

    @property
    def platform(self) -> Platform:
        """The platform every rank runs on (the device's facts and choices)."""
        return self.driver_worker.platform

    @property
    def pids(self) -> list[int]:
        """The processes this executor started besides the engine's own (none for one rank)."""
        return []

    @abstractmethod
    def determine_kv_cache_layout(self) -> KVCacheLayout:
        """The KV cache every rank can hold (the smallest block count of all ranks)."""

    @abstractmethod
    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate ``layout`` on every rank."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput,
                      overlap: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's sampled tokens. ``overlap`` runs while the device computes."""

    @property
    def supports_kv_transfer(self) -> bool:
        """Whether a KV connector can be attached (one rank: its worker owns the whole KV cache)."""
        return False

    def attach_kv_connector(self, connector: Any) -> None:
        """Give the worker a KV connector's worker half (``distributed/kv_transfer/``)."""
        raise ValueError("kv_transfer_config: KV transfer needs --tensor-parallel-size 1")

    @abstractmethod
    def close(self) -> None:
        """Stop the ranks and release what they hold (sockets, a KV connector, a placement group)."""
