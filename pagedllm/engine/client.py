"""The seam between ``AsyncLLM`` and the engine it drives: ``EngineClient``, and the stats logger it feeds.

``AsyncLLM`` drives one engine from its output thread: an ``LLMEngine`` (the core on that thread) or a
``MultiprocEngine`` (engine-core processes behind ZMQ). Both are ``EngineClient``s, so ``AsyncLLM`` calls every
method below without asking first whether the engine has it; what only engine processes need (``wake``, a death
``set_wakeup``, snapshots built in the engines) has a do-nothing default here.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from pagedllm.engine.output_processor import OutputKind
from pagedllm.engine.processor import PromptType
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

EngineOutput = RequestOutput | PoolingRequestOutput


class EngineClient(ABC):
    """An engine as ``AsyncLLM`` sees it. Not thread-safe: only ``AsyncLLM``'s output thread calls it, except
    ``wake`` and ``validate_structured_outputs`` (any thread)."""

    #: True when the engine's cores build their own cache-map snapshots (``kv_cache_snapshots``); False when
    #: ``AsyncLLM`` builds them from the in-thread core itself.
    builds_own_snapshots: bool = False

    @abstractmethod
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, kind: OutputKind = OutputKind.FINAL_ONLY,
                    cache_salt: str | None = None, add_special_tokens: bool = True, lora_request: Any = None) -> None:
        """Validate and queue a request; ValueError naming the bad field. ``lora_request``: its adapter
        (a ``LoRARequest`` or a checked ``AdapterRef``), or None."""

    @abstractmethod
    def abort_request(self, request_ids: list[str]) -> None:
        """Drop these requests (the client went away): no further output."""

    @abstractmethod
    def finish_aborted(self, request_ids: list[str]) -> list[EngineOutput]:
        """End these requests now (a shut-down): each one's final output, its unfinished samples marked 'abort'."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work (or outputs) to hand out."""

    @abstractmethod
    def step(self) -> list[EngineOutput]:
        """Run (or wait briefly for) one step of the engine; the request outputs it produced."""

    def validate_structured_outputs(self, params: SamplingParams) -> None:  # noqa: B027 - nothing by default
        """Compile the request's grammar early; ValueError if it cannot be. Without a grammar backend: nothing."""

    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Run a named engine utility between steps; the future gets its result or its error."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(ValueError(f"method: {method!r} is not an engine utility of {type(self).__name__}"))
        return future

    def kv_cache_snapshots(self) -> concurrent.futures.Future:
        """Every engine's cache map, built in the engines (only where ``builds_own_snapshots``)."""
        raise NotImplementedError(f"{type(self).__name__} builds no snapshots of its own")

    def wake(self) -> None:  # noqa: B027 - a hook: nothing to do by default
        """Any thread: make a ``step`` that waits on the engines return (a command was queued). An engine whose
        ``step`` never waits needs nothing."""

    def set_wakeup(self, fn: Callable[[], None]) -> None:  # noqa: B027 - a hook: nothing to do by default
        """``fn`` wakes the owner's idle loop when an engine dies on its own (engine processes)."""

    def shutdown(self) -> None:  # noqa: B027 - a hook: nothing to do by default
        """Release what the engine holds (processes, sockets); nothing to release by default."""


class StepStatsLogger(Protocol):
    """What ``AsyncLLM`` reports to (``metrics/stats.py``'s ``StatsRecorder``): requests, steps, and a periodic
    log line."""

    def add_request(self, request_id: str, kind: OutputKind, n: int) -> None: ...

    def record_step(self, engine: Any, outputs: list[RequestOutput], now: float) -> None: ...

    def maybe_log(self, engine: Any, now: float, force: bool = False) -> None: ...

    def forget(self, request_id: str) -> None: ...
