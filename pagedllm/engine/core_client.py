"""The API process's end of the engine-core processes: start them, shake hands, move messages, see them die.

The client binds a ROUTER (input to the engines) and a PULL (their outputs) on IPC sockets in a private temporary
folder, so nothing is reachable from outside; each engine connects a DEALER (identity = its index) and a PUSH.
Start-up: every engine says HELLO when its sockets are up and READY once its model is loaded and its KV cache
sized; one that says FAILED or exits instead fails the start-up with its reason, after the others are stopped.

One thread (``AsyncLLM``'s) uses the sockets. A watcher thread waits on the processes' sentinels: an engine that
dies without a word (SIGKILL, the OOM killer) is reported within milliseconds through ``on_death``.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.core_messages import (
    EngineMessageType,
    Ready,
    RequestType,
    encode,
    parse_frames,
)
from pagedllm.engine.core_proc import IPC_DIR_PREFIX, identity_of, run_engine_core
from pagedllm.engine.errors import EngineStartupError
from pagedllm.executor.process_watch import SentinelWatcher, describe_exit
from pagedllm.logger import init_logger

logger = init_logger(__name__)

# A model load can take minutes on a cold machine (the C++ kernels compile on first use).
STARTUP_TIMEOUT_S = 900.0
# How long a stopping engine may take before it is terminated, then killed.
SHUTDOWN_GRACE_S = 10.0


class EngineCoreClient:
    """``num_engines`` engine-core processes on this host, started from ``config``.

    ``threads_per_engine`` sets each engine's torch thread count (None: the engine's own default).
    ``target`` is the engine process's entry point (``run_engine_core``; tests wrap it to inject faults).
    """

    def __init__(self, config: EngineConfig, num_engines: int = 1, threads_per_engine: int | None = None,
                 on_death: Callable[[int, str], None] | None = None,
                 target: Callable[..., None] = run_engine_core) -> None:
        self.num_engines = num_engines
        self.on_death = on_death
        self.dead: tuple[int, str] | None = None  # (engine index, why) of the first engine that died
        self._shutting_down = False
        self._watcher: SentinelWatcher | None = None  # started once every engine is READY
        self._ipc_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.ROUTER)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone engine raises instead of vanishing
        self.input.setsockopt(zmq.LINGER, 0)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        on_ray = config.parallel.data_parallel_backend == "ray"
        if on_ray:  # engines on any node of the cluster connect over TCP to this node's address
            from pagedllm.executor.ray_engines import bind_tcp

            input_address, output_address = bind_tcp(self.input), bind_tcp(self.output)
        else:
            input_address = f"ipc://{self._ipc_dir}/input"
            output_address = f"ipc://{self._ipc_dir}/output"
            self.input.bind(input_address)
            self.output.bind(output_address)
        mp = multiprocessing.get_context("spawn")  # fork would copy this process's threads and sockets
        self.processes: list[Any] = []
        self._parent_ends: list[Any] = []
        self.ready: list[Ready] = []
        try:
            if on_ray:
                from pagedllm.executor.ray_engines import start_ray_engines

                self.processes = start_ray_engines(config, num_engines, target, input_address, output_address,
                                                   threads_per_engine)
            for index in range(0 if on_ray else num_engines):
                child_end, parent_end = mp.Pipe(duplex=False)
                # A daemonic process may not start children: an engine with tensor-parallel ranks is not one (it still
                # exits with this process, through its pipe end below).
                proc = mp.Process(target=target, name=f"pagedllm-engine-{index}",
                                  daemon=config.parallel.tensor_parallel_size == 1,
                                  args=(config, index, input_address, output_address, child_end,
                                        threads_per_engine))
                proc.start()
                child_end.close()
                self.processes.append(proc)
                self._parent_ends.append(parent_end)  # kept open: its closing tells the engine we are gone
            self.ready = self._handshake()
        except BaseException:
            self.shutdown()
            raise
        self._watcher = SentinelWatcher(self.processes, self._on_exit, name="pagedllm-engine-watch")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ---- start-up --------------------------------------------------------------------------------------------
    def _handshake(self) -> list[Ready]:
        ready: dict[int, Ready] = {}
        hello: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < self.num_engines:
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engines {sorted(set(range(self.num_engines)) - set(ready))} were not "
                                         f"ready within {STARTUP_TIMEOUT_S:.0f} s")
            for index, proc in enumerate(self.processes):
                if index not in ready and proc.exitcode is not None:
                    raise EngineStartupError(f"engine {index} exited with status {proc.exitcode} during start-up "
                                             "(see its log above)")
            if not self.input.poll(100):
                continue
            identity, *frames = self.input.recv_multipart()
            try:
                kind, message = parse_frames(frames, EngineMessageType)
            except (ValueError, msgspec.DecodeError) as e:
                logger.warning("start-up: dropped a malformed message (%s)", e)
                continue
            if kind is EngineMessageType.HELLO:
                hello.add(message.engine_index)
                logger.info("engine %d started (pid %d); loading the model", message.engine_index, message.pid)
            elif kind is EngineMessageType.FAILED:
                raise EngineStartupError(f"engine {message.engine_index} failed to start: {message.reason}")
            elif kind is EngineMessageType.READY:
                ready[message.engine_index] = message
        return [ready[i] for i in range(self.num_engines)]

    # ---- messages --------------------------------------------------------------------------------------------
    def send(self, engine_index: int, kind: RequestType, message: msgspec.Struct | None = None) -> None:
        """Queue one message for an engine. An engine that is gone raises ``zmq.ZMQError`` (host unreachable)."""
        self.input.send_multipart([identity_of(engine_index), kind.value, encode(message)], copy=False)

    def recv_outputs(self) -> list[tuple[EngineMessageType, Any]]:
        """Every message waiting on the output socket, decoded; malformed ones are logged and dropped."""
        messages = []
        while True:
            try:
                frames = self.output.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(parse_frames(frames, EngineMessageType))
            except (ValueError, msgspec.DecodeError) as e:
                logger.warning("dropped a malformed engine message (%s)", e)

    # ---- death -----------------------------------------------------------------------------------------------
    def _on_exit(self, index: int, proc: Any) -> None:  # the watcher thread
        self._report_death(index, f"engine {index} (pid {proc.pid}) {describe_exit(proc)}")

    def _report_death(self, index: int, reason: str) -> None:
        if self.dead is not None or self._shutting_down:
            return
        self.dead = (index, reason)
        logger.error("%s; in-flight requests fail and /health answers 503 (restarting is the orchestrator's job)",
                     reason)
        if self.on_death is not None:
            self.on_death(index, reason)

    def report_dead_message(self, index: int, reason: str) -> None:
        """An engine said DEAD (its loop raised) before it exits."""
        self._report_death(index, f"engine {index} died: {reason}")

    # ---- shut-down -------------------------------------------------------------------------------------------
    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop every engine (SHUTDOWN, then SIGTERM, then SIGKILL), close the sockets. Idempotent."""
        if self._shutting_down:
            return
        self._shutting_down = True
        if self._watcher is not None:
            self._watcher.stop()
        for index, proc in enumerate(self.processes):
            if proc.is_alive():
                try:
                    self.send(index, RequestType.SHUTDOWN)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for end in self._parent_ends:
            end.close()
        self.input.close()
        self.output.close()
        self.ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
