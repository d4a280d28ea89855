"""The engine core in its own process: same outputs as in-process, death seen within seconds, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_proc import identity_of
from pagedllm.engine.errors import EngineDeadError, EngineStartupError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.mp_engine import MultiprocEngine
from pagedllm.engine_args import EngineArgs
from pagedllm.sampling_params import SamplingParams

from helpers.faulty_engine import run_engine_core_failing_after, run_engine_core_failing_at_start

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _config(**kw):
    return EngineArgs(kv_cache_memory="64MiB", max_model_len=1024, dtype="float32", **kw).create_engine_config()


async def _generate(llm: AsyncLLM, prompt: str, rid: str, params: SamplingParams = GREEDY) -> tuple[str, list[int]]:
    text, ids = "", []
    async for out in llm.generate(prompt, params, rid):
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
    return text, ids


def _run_all(llm: AsyncLLM, params: SamplingParams = GREEDY) -> list[tuple[str, list[int]]]:
    async def main():
        return await asyncio.gather(*[_generate(llm, p, f"r{i}", params) for i, p in enumerate(PROMPTS)])
    return asyncio.run(main())


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_process_outputs_equal_in_process_and_leave_no_process() -> None:
    inproc = AsyncLLM(LLMEngine(_config()))
    try:
        expected = _run_all(inproc)
    finally:
        inproc.shutdown(1.0)
    engine = MultiprocEngine(_config())
    pids = engine.pids
    assert len(pids) == 1 and pids[0] != os.getpid()
    # Frames the engine cannot read (unknown type, garbage payload, wrong shape) are dropped, not fatal.
    for frames in ([b"?", b"junk"], [b"A", b"\xc1not msgpack"], [b"A"], [b"X", b"\x93\x01\x02\x03"]):
        engine.client.input.send_multipart([identity_of(0), *frames])
    llm = AsyncLLM(engine)
    try:
        assert _run_all(llm) == expected
        assert asyncio.run(llm.call_utility("reset_prefix_cache")) >= 1  # the prompts' blocks were cached
        snap = asyncio.run(llm.kv_cache_snapshot())
        assert b'"engines":[' in snap.json_bytes and b'"num_blocks"' in snap.json_bytes
    finally:
        llm.shutdown(5.0)
    assert _alive(pids) == []


def test_data_parallel_two_engines_give_the_same_greedy_outputs() -> None:
    engine = MultiprocEngine(_config())
    llm = AsyncLLM(engine)
    try:
        expected = _run_all(llm)
    finally:
        llm.shutdown(5.0)
    engine = MultiprocEngine(_config(data_parallel_size=2, data_parallel_routing="round-robin"))
    pids = engine.pids
    assert len(set(pids)) == 2
    llm = AsyncLLM(engine)
    try:
        assert _run_all(llm) == expected
        stats = engine.take_stats()
        assert {s.engine_index for s in stats} <= {0, 1}
    finally:
        llm.shutdown(5.0)
    assert _alive(pids) == []


def test_sigkill_of_the_engine_fails_streams_quickly() -> None:
    engine = MultiprocEngine(_config())
    pid = engine.pids[0]
    llm = AsyncLLM(engine)
    long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)

    async def main():
        streams = [asyncio.ensure_future(_generate(llm, p, f"k{i}", long)) for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
        return results, time.monotonic() - start

    try:
        results, waited = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "killed by signal 9" in str(results[0])
        assert waited < 30
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(_generate(llm, "after", "late"))
    finally:
        llm.shutdown(1.0)
    assert _alive([pid]) == []


def test_exception_in_the_engine_loop_is_reported_as_dead() -> None:
    engine = MultiprocEngine(_config(), engine_target=run_engine_core_failing_after)
    pid = engine.pids[0]
    llm = AsyncLLM(engine)
    try:
        with pytest.raises(EngineDeadError, match="injected engine-loop failure"):
            asyncio.run(asyncio.wait_for(_generate(llm, PROMPTS[0], "x", SamplingParams(max_tokens=50)), 30))
        assert not llm.is_running
    finally:
        llm.shutdown(1.0)
    assert _alive([pid]) == []


def test_a_failed_start_up_names_the_reason_and_leaves_nothing() -> None:
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(EngineStartupError, match="injected start-up failure"):
        MultiprocEngine(_config(), engine_target=run_engine_core_failing_at_start)
    time.sleep(0.5)
    after = {c.pid for c in psutil.Process().children(recursive=True)}
    assert _alive(sorted(after - before)) == []


_API_PROCESS = """
import time
from test_engine_process import _config
from pagedllm.engine.mp_engine import MultiprocEngine
if __name__ == "__main__":  # the engine process is spawned: it imports this file again
    engine = MultiprocEngine(_config())
    print(engine.client._ipc_dir, *engine.pids, flush=True)
    time.sleep(600)
"""


def test_sigkill_of_the_api_process_ends_the_engine_and_removes_its_sockets(tmp_path) -> None:
    """The API process's private socket folder cannot be removed by a SIGKILLed API process: its engine does."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent  # this module, and tests/ for the helpers it imports
    script = tmp_path / "api_process.py"
    script.write_text(_API_PROCESS)
    path = os.pathsep.join([str(here), str(here.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    api = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": path})
    try:
        ipc_dir, *pids = api.stdout.readline().split()
        assert os.path.isdir(ipc_dir) and os.path.basename(ipc_dir).startswith("pagedllm-engine-")
        api.send_signal(signal.SIGKILL)
        api.wait(10)
        deadline = time.monotonic() + 30
        while (_alive([int(p) for p in pids]) or os.path.exists(ipc_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive([int(p) for p in pids]) == []
        assert not os.path.exists(ipc_dir)
    finally:
        api.kill()
