"""``--distributed-executor-backend mp``: one process per tensor-parallel rank on this host.

Rank 0 is the engine's own process (its ``Worker`` returns the sampled tokens, as the single-process worker
does); ranks 1..T-1 are spawned (``tp_worker_proc.run_tp_worker``). Each step, the scheduler output is
published once to all ranks (``step_broadcast.py``); every rank then runs the same step, joined by the
all-reduces of the parallel layers, and computes the same tokens: only rank 0's are used.

A rank that exits ends the engine: a watcher notices its process sentinel, and the next (or the current)
step raises ``RankDiedError``, which the engine core treats as fatal (the engine-death path: DEAD, then 503).
"""

from __future__ import annotations

import multiprocessing
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import zmq

from pagedllm.config import EngineConfig, KVCacheLayout
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import RANK_STARTUP_TIMEOUT_S
from pagedllm.executor.base import Executor, RankDiedError
from pagedllm.executor.process_watch import SentinelWatcher
from pagedllm.executor.step_broadcast import StepPublisher
from pagedllm.logger import init_logger

if TYPE_CHECKING:
    from pagedllm.worker.worker import Worker

logger = init_logger(__name__)

__all__ = ["MultiprocExecutor", "RankDiedError", "free_tcp_port", "threads_per_rank"]


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world_size: int) -> int:
    """This process's CPU threads (the engine's share of the host) split between the ranks, at least one each."""
    from pagedllm import envs
    from pagedllm.utils import physical_cpu_cores

    total = int(envs.OMP_NUM_THREADS) if envs.OMP_NUM_THREADS else physical_cpu_cores()
    return max(1, total // world_size)


class MultiprocExecutor(Executor):
    """Tensor-parallel ranks on this host: rank 0's ``Worker`` here (``driver_worker``), ranks 1..T-1 in spawned
    processes; ``RayExecutor`` places those in Ray actors instead."""

    def __init__(self, config: EngineConfig, rank_target: Callable[..., None] | None = None) -> None:
        from pagedllm.executor.tp_worker_proc import run_tp_worker
        from pagedllm.worker.worker import Worker

        self.config = config
        self.world_size = world = config.parallel.tensor_parallel_size
        self.dead: str | None = None
        self._closing = False
        self._watcher: SentinelWatcher | None = None
        self.worker: Worker | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-tp-")
        self.ctx = zmq.Context()
        step_address, answer_address, init_method = self._addresses()
        self.publisher = StepPublisher(self.ctx, step_address, answer_address)
        step_address, answer_address = self._connect_addresses(step_address, answer_address)
        threads = threads_per_rank(world)
        self.processes: list[Any] = []
        self._parent_ends: list[Any] = []
        start = time.perf_counter()
        try:
            for rank in range(1, world):
                self.processes.append(self._start_rank(rank_target or run_tp_worker, config, rank, init_method,
                                                       step_address, answer_address, threads))
            torch.set_num_threads(threads)
            self.worker = Worker(config, tp_rank=0, tp_init_method=init_method, tp_alive=self._check_alive)
            torch.set_num_threads(threads)  # prepare_worker set the whole host's count
            self.startup_s = time.perf_counter() - start
            logger.info("tensor parallel: %d ranks (%s backend, %s executor), %d CPU threads each; ranks ready in "
                        "%.1f s", world, self.worker.tp.backend, self.backend_name, threads, self.startup_s)
        except BaseException:
            self.close()
            raise
        self._watcher = SentinelWatcher(self.processes, self._on_rank_exit, name="pagedllm-tp-watch", join_s=0.1)

    backend_name = "mp"

    def _addresses(self) -> tuple[str, str, str]:
        """(step PUB, answers PULL, torch.distributed rendezvous): this host only."""
        return (f"ipc://{self._ipc_dir}/steps", f"ipc://{self._ipc_dir}/answers",
                f"tcp://127.0.0.1:{free_tcp_port()}")

    def _connect_addresses(self, step_address: str, answer_address: str) -> tuple[str, str]:
        return step_address, answer_address

    def _start_rank(self, target: Callable[..., None], config: EngineConfig, rank: int, init_method: str,
                    step_address: str, answer_address: str, threads: int) -> Any:
        mp = multiprocessing.get_context("spawn")
        child_end, parent_end = mp.Pipe(duplex=False)
        proc = mp.Process(target=target, name=f"pagedllm-tp-rank-{rank}", daemon=True,
                          args=(config, rank, init_method, step_address, answer_address, child_end, threads))
        proc.start()
        child_end.close()
        self._parent_ends.append(parent_end)  # kept open: its closing tells the rank we are gone
        return proc

    @property
    def driver_worker(self) -> Worker:
        assert self.worker is not None, "rank 0's worker is built in __init__"
        return self.worker

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ---- start-up --------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.processes, start=1):
            if proc.exitcode is not None:
                raise RankDiedError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status "
                                    f"{proc.exitcode}")

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        """Rank 0's layout with the KV blocks every rank can hold: the smallest of the ranks' own answers."""
        own = self.driver_worker.determine_kv_cache_layout()
        answers: dict[int, int] = {}
        deadline = time.monotonic() + RANK_STARTUP_TIMEOUT_S
        while len(answers) < self.world_size - 1:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel ranks did not size their KV caches in time")
            ready = self.publisher.recv_ready(100)
            if ready is not None:
                answers[ready.rank] = ready.num_blocks
        self.publisher.wait_subscribed(self.world_size - 1, 60.0, self._check_alive)
        return replace(own, num_blocks=min([own.num_blocks, *answers.values()]))

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        self.publisher.send_init(layout)
        self.driver_worker.init_kv_cache(layout)

    # ---- steps -----------------------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput, overlap: Callable[[], None] | None = None) -> ModelRunnerOutput:
        if self.dead is not None:
            raise RankDiedError(self.dead)
        self.publisher.send_step(sched)
        try:
            return self.driver_worker.execute_model(sched, overlap)
        except Exception as e:
            time.sleep(0.2)  # a peer's death closes the sockets a moment before its exit status is known
            if self.dead is not None or any(p.exitcode is not None for p in self.processes):
                self._check_alive()
                raise RankDiedError(self.dead or "a tensor-parallel rank died") from e
            raise

    def _on_rank_exit(self, index: int, proc: Any) -> None:  # the watcher thread
        if self._closing:
            return
        self.dead = f"tensor-parallel rank {index + 1} (pid {proc.pid}) exited with status {proc.exitcode}"
        logger.error("%s: the engine stops", self.dead)

    def _release(self) -> None:
        """What the backend holds beyond the processes (a Ray placement group)."""

    def close(self) -> None:
        """Stop the ranks (a STOP message, then SIGTERM for those that do not leave) and release the sockets."""
        self._closing = True
        if self._watcher is not None:
            self._watcher.stop()
        try:
            self.publisher.send_stop()
        except zmq.ZMQError:
            pass
        for proc in self.processes:
            proc.join(2.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
        self.publisher.close()
        self.ctx.term()
        self._release()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self.worker is not None:
            self.worker.close_parallel()
