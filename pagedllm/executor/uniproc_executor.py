"""``--distributed-executor-backend uni``: one worker in the engine's own process (one rank)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig, KVCacheLayout
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.worker.worker import Worker


class UniprocExecutor(Executor):
    """The engine core's calls go straight to its one ``Worker``; only it can take a KV connector."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)

    @property
    def driver_worker(self) -> Worker:
        return self.worker

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        return self.worker.determine_kv_cache_layout()

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self.worker.init_kv_cache(layout)

    def execute_model(self, sched: SchedulerOutput,
                      overlap: Callable[[], None] | None = None) -> ModelRunnerOutput:
        return self.worker.execute_model(sched, overlap)

    @property
    def supports_kv_transfer(self) -> bool:
        return True

    def attach_kv_connector(self, connector: Any) -> None:
        self.worker.attach_kv_connector(connector)

    def close(self) -> None:
        """Shut a KV connector down (its transfers, its sockets); the worker itself holds nothing to release."""
        connector, self.worker.kv_connector = self.worker.kv_connector, None
        if connector is not None:
            connector.shutdown()
