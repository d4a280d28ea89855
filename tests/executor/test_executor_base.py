"""The engine core runs its model through an ``Executor`` (uni, mp, ray): one abstract interface, one place that
chooses, one Ray actor class for engines and ranks, and the process-death watchers in one module."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pagedllm.config import KVCacheLayout
from pagedllm.executor import ray_engines, ray_executor, ray_utils
from pagedllm.executor.base import Executor, RankDiedError
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.executor.process_watch import SentinelWatcher, describe_exit, exit_with_parent
from pagedllm.executor.ray_executor import RayExecutor
from pagedllm.executor.uniproc_executor import UniprocExecutor

from helpers.arch_configs import save_tiny


def test_every_backend_is_an_executor_and_the_base_is_abstract() -> None:
    assert issubclass(UniprocExecutor, Executor) and issubclass(MultiprocExecutor, Executor)
    assert issubclass(RayExecutor, MultiprocExecutor)
    with pytest.raises(TypeError):
        Executor()  # type: ignore[abstract]

    class Partial(Executor):
        def determine_kv_cache_layout(self) -> KVCacheLayout:
            return KVCacheLayout(num_blocks=2)

    with pytest.raises(TypeError):
        Partial()  # type: ignore[abstract]
    assert RankDiedError.fatal  # the engine core stops on it instead of retrying requests one by one


def test_tensor_parallel_executors_refuse_a_kv_connector() -> None:
    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # the refusal needs no ranks
    assert not executor.supports_kv_transfer
    with pytest.raises(ValueError, match="KV transfer needs --tensor-parallel-size 1"):
        executor.attach_kv_connector(object())


def test_one_ray_actor_class_runs_engines_and_ranks() -> None:
    assert ray_engines.ProcessActor is ray_executor.ProcessActor is ray_utils.ProcessActor
    assert not hasattr(ray_engines, "EngineCoreActor") and not hasattr(ray_executor, "RankActor")
    actor = ray_utils.ProcessActor()
    seen: list[tuple] = []
    actor.run(lambda *args: seen.append(args), 1, "two")
    assert actor.pid() == os.getpid() and seen == [(1, "two")]


def test_the_uni_executor_serves_the_engine_core(tmp_path) -> None:
    from pagedllm.engine.engine_core import EngineCore
    from pagedllm.engine_args import EngineArgs

    config = EngineArgs(model=save_tiny("LlamaForCausalLM", tmp_path / "m")[0], dtype="float32", kv_cache_memory="4MiB",
                        max_model_len=128, enforce_eager=True).create_engine_config()
    core = EngineCore(config)
    try:
        assert isinstance(core.executor, UniprocExecutor) and core.executor.supports_kv_transfer
        assert core.worker is core.executor.driver_worker and core.executor.platform.name == "cpu"
        assert core.executor.pids == []
        assert core.kv_cache_layout == core.executor.driver_worker.determine_kv_cache_layout()
    finally:
        core.close()


def _exit_with(code: int) -> None:
    os._exit(code)


def _sleep_then_exit() -> None:
    time.sleep(30)


def test_the_sentinel_watcher_reports_the_first_child_that_ends() -> None:
    ctx = multiprocessing.get_context("fork")
    slow, fast = ctx.Process(target=_sleep_then_exit), ctx.Process(target=_exit_with, args=(3,))
    slow.start()
    fast.start()
    seen: list[tuple[int, str]] = []
    done = threading.Event()
    watcher = SentinelWatcher([slow, fast], lambda i, p: (seen.append((i, describe_exit(p))), done.set()), "t")
    try:
        assert done.wait(10.0)
        assert seen == [(1, "exited with status 3")]
    finally:
        watcher.stop()
        os.kill(slow.pid, signal.SIGKILL)
        slow.join(5.0)
    assert describe_exit(slow) == "killed by signal 9"


def test_a_stopped_watcher_reports_nothing() -> None:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_sleep_then_exit)
    proc.start()
    seen: list[int] = []
    watcher = SentinelWatcher([proc], lambda i, p: seen.append(i), "t")
    watcher.stop()
    watcher.stop()  # idempotent
    proc.kill()
    proc.join(5.0)
    time.sleep(0.2)
    assert seen == []


def _child_of(child_end, parent_end, marker: str) -> None:
    parent_end.close()  # forked: only the parent may hold the writing end
    exit_with_parent(child_end, "child", "the test", on_exit=lambda: Path(marker).write_text("ran"))
    time.sleep(30)
    os._exit(5)  # reached only if the watch failed


def test_a_child_exits_when_its_parent_end_closes(tmp_path) -> None:
    ctx = multiprocessing.get_context("fork")
    child_end, parent_end = ctx.Pipe(duplex=False)
    marker = tmp_path / "on_exit"
    proc = ctx.Process(target=_child_of, args=(child_end, parent_end, str(marker)))
    proc.start()
    child_end.close()
    parent_end.close()  # what a SIGKILLed parent's exit does
    proc.join(10.0)
    assert proc.exitcode == 0 and marker.read_text() == "ran"
