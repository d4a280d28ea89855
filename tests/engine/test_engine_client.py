"""``AsyncLLM`` drives an ``EngineClient`` (``engine/client.py``) without probing it: both real engines are one,
an engine's hooks (wake, death wake-up, shut-down, its own snapshots) are called through the base class, and
the engine errors live in one module that the engines and the front end share."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import threading

import pytest

from pagedllm.engine import async_llm, errors, mp_engine
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.client import EngineClient
from pagedllm.engine.core_client import EngineStartupError
from pagedllm.engine.front_end import EngineFrontEnd
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.mp_engine import MultiprocEngine
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


class CountingEngine(EngineClient):
    """One token per step; counts the hook calls AsyncLLM makes."""

    def __init__(self, own_snapshots: bool = False) -> None:
        self.builds_own_snapshots = own_snapshots
        self.left: dict[str, int] = {}
        self.wakes = 0
        self.wakeup = None
        self.shut = threading.Event()
        self.finished: list[str] = []

    def add_request(self, request_id, prompt, params, arrival_time=None, kind=None, cache_salt=None,
                    add_special_tokens=True) -> None:
        self.left[request_id] = params.max_tokens

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            self.left.pop(rid, None)

    def finish_aborted(self, request_ids) -> list[RequestOutput]:
        self.finished.extend(request_ids)
        self.abort_request(request_ids)
        return [RequestOutput(r, None, [1], [CompletionOutput(0, "", [], finish_reason="abort")], finished=True)
                for r in request_ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [7], finish_reason="length"
                                                                        if done else None)], finished=done))
            if done:
                del self.left[rid]
        return outs

    def wake(self) -> None:
        self.wakes += 1

    def set_wakeup(self, fn) -> None:
        self.wakeup = fn

    def kv_cache_snapshots(self) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result({"engines": ["mine"]})
        return future

    def shutdown(self) -> None:
        self.shut.set()


def test_both_engines_are_engine_clients() -> None:
    assert issubclass(LLMEngine, EngineClient) and issubclass(MultiprocEngine, EngineClient)
    assert issubclass(LLMEngine, EngineFrontEnd) and issubclass(MultiprocEngine, EngineFrontEnd)
    assert MultiprocEngine.builds_own_snapshots and not LLMEngine.builds_own_snapshots
    with pytest.raises(TypeError):
        EngineClient()  # type: ignore[abstract]


def test_async_llm_calls_the_hooks_of_the_base_class() -> None:
    engine = CountingEngine(own_snapshots=True)
    llm = AsyncLLM(engine)
    try:
        assert engine.wakeup is not None  # AsyncLLM's notify, for an engine that dies on its own

        async def main() -> tuple[list[RequestOutput], object]:
            outs = [o async for o in llm.generate("hi", SamplingParams(max_tokens=3), "r")]
            return outs, await llm.kv_cache_snapshot()

        outs, snapshot = asyncio.run(main())
        assert outs[-1].finished and engine.wakes >= 1
        assert snapshot == {"engines": ["mine"]}  # built by the engine, not by AsyncLLM
    finally:
        llm.shutdown()
    assert engine.shut.is_set()


def test_a_plain_engine_needs_only_the_abstract_methods() -> None:
    class Plain(CountingEngine):
        wake = EngineClient.wake
        set_wakeup = EngineClient.set_wakeup
        shutdown = EngineClient.shutdown

    llm = AsyncLLM(Plain())

    async def main() -> list[RequestOutput]:
        return [o async for o in llm.generate("hi", SamplingParams(max_tokens=2), "r")]

    try:
        assert asyncio.run(main())[-1].finished
    finally:
        llm.shutdown()


def test_shutdown_ends_in_flight_requests_through_the_engine() -> None:
    engine = CountingEngine()
    engine.step = lambda: []  # never finishes on its own
    llm = AsyncLLM(engine)

    async def main() -> list[RequestOutput]:
        outs = []
        async for out in llm.generate("hi", SamplingParams(max_tokens=5), "r"):
            outs.append(out)
        return outs

    async def run() -> list[RequestOutput]:
        task = asyncio.ensure_future(main())
        await asyncio.sleep(0.1)
        await asyncio.to_thread(llm.shutdown, 0.0)
        return await asyncio.wait_for(task, 10)

    outs = asyncio.run(run())
    assert engine.finished == ["r"] and outs[-1].outputs[0].finish_reason == "abort"


def test_the_engine_errors_live_in_one_module() -> None:
    assert async_llm.EngineDeadError is errors.EngineDeadError is mp_engine.EngineDeadError
    assert async_llm.RequestFailedError is errors.RequestFailedError
    assert EngineStartupError is errors.EngineStartupError


@pytest.mark.parametrize(("module", "must_not_load"), [
    ("pagedllm.engine.mp_engine", "pagedllm.engine.async_llm"),
    ("pagedllm.executor.tp_worker_proc", "pagedllm.engine"),
    ("pagedllm.executor.multiproc_executor", "pagedllm.engine"),
])
def test_no_import_loop_between_the_rooms(module: str, must_not_load: str) -> None:
    code = (f"import sys, {module}; loaded = [m for m in sys.modules if m == {must_not_load!r} or "
            f"m.startswith({must_not_load!r} + '.')]; print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
