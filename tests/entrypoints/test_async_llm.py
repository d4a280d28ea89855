"""AsyncLLM with a fake engine (no model): streams, validation, abort on exit, engine death, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.client import EngineClient
from pagedllm.engine.errors import EngineDeadError, RequestFailedError
from pagedllm.entrypoints.openai.api_server import ServerOptions, build_app
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


class FakeEngine(EngineClient):
    """Each request makes ``max_tokens`` steps of one token; 'bad' prompts are rejected."""

    def __init__(self, step_s: float = 0.005) -> None:
        self.left: dict[str, int] = {}
        self.aborted: list[str] = []
        self.poisoned: set[str] = set()
        self.fail = threading.Event()
        self.step_s = step_s
        self.step_thread: str | None = None
        self.output_processor = SimpleNamespace(child_ids=lambda rid: [rid],
                                                make_abort_output=self._abort_out)
        self.core = SimpleNamespace(abort_requests=self.abort_request)

    def add_request(self, request_id, prompt, params, arrival_time=None, kind=None, cache_salt=None,
                    add_special_tokens=True) -> None:
        if prompt == "bad":
            raise ValueError("prompt: bad prompt")
        self.left[request_id] = params.max_tokens
        if prompt == "poison":  # the model step fails on it (the engine core then ends it as "error")
            self.poisoned.add(request_id)

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            if self.left.pop(rid, None) is not None:
                self.aborted.append(rid)

    def _abort_out(self, rid: str) -> RequestOutput:
        aborted = CompletionOutput(0, "", [], finish_reason="abort")
        return RequestOutput(rid, None, [1], [aborted], finished=True)

    def finish_aborted(self, request_ids) -> list[RequestOutput]:
        self.core.abort_requests(request_ids)
        return [self._abort_out(rid) for rid in request_ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestOutput]:
        self.step_thread = threading.current_thread().name
        time.sleep(self.step_s)
        if self.fail.is_set():
            raise RuntimeError("CUDA fell over")
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0 or rid in self.poisoned
            reason = "error" if rid in self.poisoned else "length" if done else None
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(0, "", [], finish_reason=reason)
                                                      if rid in self.poisoned else
                                                      CompletionOutput(0, "x", [7], finish_reason=reason)],
                                      finished=done))
            if done:
                del self.left[rid]
        return outs


async def _collect(llm: AsyncLLM, rid: str, prompt: str = "hi", n: int = 3) -> list[RequestOutput]:
    return [o async for o in llm.generate(prompt, SamplingParams(max_tokens=n), rid)]


def test_streams_run_in_the_engine_thread():
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    try:
        async def main():
            return await asyncio.gather(*[_collect(llm, f"r{i}", n=2 + i) for i in range(5)])
        results = asyncio.run(main())
        assert [len(r) for r in results] == [2, 3, 4, 5, 6]
        assert all(r[-1].finished and not any(o.finished for o in r[:-1]) for r in results)
        assert engine.step_thread == "pagedllm-engine"
    finally:
        llm.shutdown(1)


def test_validation_error_before_streaming():
    llm = AsyncLLM(FakeEngine())
    try:
        with pytest.raises(ValueError, match="prompt"):
            asyncio.run(_collect(llm, "r", prompt="bad"))
        assert len(asyncio.run(_collect(llm, "r2"))) == 3  # still serving
    finally:
        llm.shutdown(1)


def test_failed_request_raises_and_others_carry_on():
    llm = AsyncLLM(FakeEngine())
    try:
        async def main():
            bad = asyncio.ensure_future(_collect(llm, "p", prompt="poison", n=5))
            good = asyncio.ensure_future(_collect(llm, "g", n=5))
            with pytest.raises(RequestFailedError, match="request p"):
                await bad
            return await good
        assert len(asyncio.run(main())) == 5
        assert llm.is_running
    finally:
        llm.shutdown(1)


def test_leaving_early_aborts_once():
    engine = FakeEngine(step_s=0.01)
    llm = AsyncLLM(engine)
    try:
        async def main():
            gen = llm.generate("hi", SamplingParams(max_tokens=1000), "long")
            async for _ in gen:
                break
            await gen.aclose()
            task = asyncio.ensure_future(_collect(llm, "cancelled", n=1000))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.1)
        asyncio.run(main())
        assert sorted(engine.aborted) == ["cancelled", "long"]
        assert not engine.left
    finally:
        llm.shutdown(1)


def test_cancel_while_add_is_queued_leaks_nothing():
    engine = FakeEngine(step_s=0.2)
    llm = AsyncLLM(engine)
    try:
        async def main():
            busy = asyncio.ensure_future(_collect(llm, "busy", n=3))
            await asyncio.sleep(0.05)  # the engine thread is inside a step now
            for i in range(3):
                task = asyncio.ensure_future(_collect(llm, f"gone{i}", n=100))
                await asyncio.sleep(0)
                task.cancel()
            await busy
            await asyncio.sleep(0.3)
        asyncio.run(main())
        assert not engine.left and llm.is_running and llm.num_in_flight() == 0
    finally:
        llm.shutdown(1)


def test_engine_death_fails_fast_and_health_503():
    engine = FakeEngine(step_s=0.01)
    llm = AsyncLLM(engine)
    fake_model = SimpleNamespace(model_path="fake", model="fake")
    fake_core = SimpleNamespace(get_tokenizer=lambda: object(), processor=SimpleNamespace(max_model_len=64),
                                config=SimpleNamespace(model=fake_model))

    async def main():
        llm.engine = fake_core  # build_app only reads static facts from the engine
        app = build_app(llm, ServerOptions(served_model_names=["fake"]))
        llm.engine = engine
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/health")).status_code == 200
            in_flight = asyncio.ensure_future(_collect(llm, "victim", n=10_000))
            await asyncio.sleep(0.05)
            engine.fail.set()
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="CUDA fell over"):
                await asyncio.wait_for(in_flight, 5)
            assert time.monotonic() - start < 2
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(_collect(llm, "late"), 2)
            r = await http.get("/health")
            assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
    asyncio.run(main())
    assert not llm.is_running
    llm.shutdown(1)


def test_shutdown_aborts_what_outlives_the_timeout():
    engine = FakeEngine(step_s=0.01)
    llm = AsyncLLM(engine)

    async def main():
        task = asyncio.ensure_future(_collect(llm, "slow", n=100_000))
        quick = asyncio.ensure_future(_collect(llm, "quick", n=3))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(llm.shutdown, 0.2)
        outs = await asyncio.wait_for(task, 5)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert (await quick)[-1].outputs[0].finish_reason == "length"
        with pytest.raises(EngineDeadError):
            await _collect(llm, "after")
    asyncio.run(main())
    assert not llm._thread.is_alive()
