"""An engine core in its own process: the scheduler, KV cache manager, worker, grammar matchers and drafter behind
ZMQ sockets (``engine/core_messages.py`` has the protocol, ``engine/core_client.py`` the other end).

The busy loop takes every queued message (add, abort, utility call, shut-down), runs one step when there is work,
and pushes that step's outputs with the scheduler's stats. It never waits on the API process: outputs are queued
by ZMQ's I/O thread, and an idle engine sleeps in ``poll`` until a message arrives.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.core_messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineMessageType,
    Failure,
    Hello,
    Ready,
    RequestType,
    UtilityCall,
    UtilityResult,
    encode,
    parse_frames,
)
from pagedllm.engine.encoder_inputs import unpack_encoder_input
from pagedllm.engine.engine_snapshot import SnapshotPublisher
from pagedllm.executor.process_watch import exit_with_parent
from pagedllm.logger import init_logger
from pagedllm.multimodal.wire import unpack_mm_features
from pagedllm.utils import freeze_gc_heap

logger = init_logger(__name__)

# How long an idle engine sleeps in poll before it looks again (it wakes at once when a message arrives).
_IDLE_POLL_MS = 1000


def identity_of(engine_index: int) -> bytes:
    """The DEALER identity of engine ``engine_index`` (the ROUTER addresses it by this)."""
    return engine_index.to_bytes(2, "little")


class EngineCoreProc:
    """The loop of one engine process. ``core`` is the ``EngineCore``; ``snapshots`` feeds the playground's map."""

    # Named calls the API process may make between steps (UtilityCall.method).
    UTILITIES = frozenset({"reset_prefix_cache", "kv_cache_snapshot"})

    def __init__(self, config: EngineConfig, engine_index: int, input_socket: zmq.Socket,
                 output_socket: zmq.Socket) -> None:
        from pagedllm.engine.engine_core import EngineCore
        from pagedllm.model_executor.loader import load_tokenizer

        self.config = config
        self.engine_index = engine_index
        self.input = input_socket
        self.output = output_socket
        self.core = EngineCore(config, engine_index)
        self.core.attach_structured_outputs(load_tokenizer(config.model))  # matchers need the vocabulary
        logger.debug("engine %d: %d start-up objects frozen out of the garbage collector", engine_index,
                     freeze_gc_heap())  # this process holds this one engine until it exits
        self.snapshots = SnapshotPublisher()
        self._stopping = False
        self._idle_kv_usage: float | None = None  # KV usage last reported while only transfers were pending
        # The price of the boundary on this side: time spent encoding and queueing output messages.
        self.num_output_messages = 0
        self.output_message_time_s = 0.0

    def ready_message(self) -> Ready:
        layout, scheduler = self.core.kv_cache_layout, self.config.scheduler
        return Ready(engine_index=self.engine_index, num_blocks=layout.num_blocks,
                     max_model_len=scheduler.max_model_len, sliding_window=layout.sliding_window,
                     sliding_group_window=layout.sliding_group_window,
                     sliding_group_num_blocks=layout.sliding_group_num_blocks,
                     num_lookahead_tokens=scheduler.num_lookahead_tokens, device=layout.device,
                     cross_group_num_blocks=layout.cross_group_num_blocks)

    # ---- the loop --------------------------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        while not self._stopping:
            busy = core.has_unfinished_requests()
            if not busy:
                self.snapshots.flush(self)
            handled = self._handle_input(block=not busy)
            if self._stopping:
                break
            if core.has_unfinished_requests():
                start = time.perf_counter()
                outputs = core.step()
                step_time = time.perf_counter() - start
                if not outputs and self._only_transfers_changed_nothing():
                    continue  # idle steps that only poll KV transfers: no message unless the cache changed
                self._send_outputs(outputs)
                self.snapshots.after_step(self, step_time)
            elif handled:
                # Adds or aborts with no step to follow (e.g. an abort freed blocks): report the new state.
                self._send_outputs([])
                self.snapshots.after_step(self, None)

    def _only_transfers_changed_nothing(self) -> bool:
        """True when the engine stepped only to poll a KV connector's transfers and its KV usage is the same as
        after the previous such step (the front end has heard it already)."""
        sched = self.core.scheduler
        if sched.has_unfinished_requests():
            self._idle_kv_usage = None
            return False
        previous, self._idle_kv_usage = self._idle_kv_usage, sched.kv.usage
        return previous == self._idle_kv_usage

    def _handle_input(self, block: bool) -> bool:
        """Every queued message; waits for one first when ``block``. Returns whether any was handled."""
        if block and not self.input.poll(_IDLE_POLL_MS):
            return False
        handled = False
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return handled
            handled = True
            try:
                kind, message = parse_frames(frames, RequestType)
            except Exception as e:  # noqa: BLE001 - a malformed frame is dropped, never fatal
                logger.warning("engine %d: dropped a malformed message (%s)", self.engine_index, e)
                continue
            self._handle(kind, message)

    def _handle(self, kind: RequestType, message: Any) -> None:
        if kind is RequestType.ADD:
            self._add(message)
        elif kind is RequestType.ABORT:
            self._abort(message)
        elif kind is RequestType.UTILITY:
            self._utility(message)
        elif kind is RequestType.SHUTDOWN:
            self._stopping = True

    def _add(self, req: EngineCoreRequest) -> None:
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                          req.max_tokens, req.arrival_time, req.cache_salt, req.pooling_params,
                          encoder_input=unpack_encoder_input(req.encoder_input, req.encoder_input_shape),
                          mm_features=unpack_mm_features(req.mm_features), lora=req.lora)
        try:
            self.core.add_request(request)
        except ValueError as e:  # the API side checked the prompt; anything left fails this request only
            logger.warning("engine %d: request %s rejected: %s", self.engine_index, req.request_id, e)
            self._send_outputs([EngineCoreOutput(req.request_id, [], finish_reason="error", stop_reason=str(e))])

    def _abort(self, message: AbortRequests) -> None:
        if message.reason == "stop":
            self.core.finish_stopped(message.request_ids)
        else:
            self.core.abort_requests(message.request_ids)

    def _utility(self, call: UtilityCall) -> None:
        if call.method not in self.UTILITIES:
            result = UtilityResult(call.call_id, error=f"method: {call.method!r} is not an engine utility; "
                                                         f"known: {sorted(self.UTILITIES)}")
        else:
            try:
                result = UtilityResult(call.call_id, getattr(self, call.method)(*call.args))
            except Exception as e:  # noqa: BLE001 - the caller gets the error, the loop goes on
                logger.exception("engine %d: utility %s failed", self.engine_index, call.method)
                result = UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
        self.output.send_multipart([EngineMessageType.OUTPUTS.value, encode(EngineCoreOutputs(
            self.engine_index, utility_result=result, timestamp=time.time()))])

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        start = time.perf_counter()
        for out in outputs:
            if out.pooling_output is not None and not isinstance(out.pooling_output, bytes):
                out.pooling_output = out.pooling_output.float().contiguous().numpy().tobytes()
        message = EngineCoreOutputs(self.engine_index, outputs, self.core.take_stats(),
                                    timestamp=time.time())
        self.output.send_multipart([EngineMessageType.OUTPUTS.value, encode(message)])
        self.num_output_messages += 1
        self.output_message_time_s += time.perf_counter() - start

    def log_boundary_cost(self) -> None:
        if self.num_output_messages:
            logger.info("engine %d: %d output messages, %.1f us each to encode and queue (mean)", self.engine_index,
                        self.num_output_messages, self.output_message_time_s / self.num_output_messages * 1e6)

    # ---- utilities ---------------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def kv_cache_snapshot(self) -> dict | None:
        """The playground's block map of this engine (``EngineSnapshot.to_dict``), or None if it cannot be built."""
        self.snapshots.watch()
        snap = self.snapshots.publish(self) if self.snapshots.is_stale() else self.snapshots.latest
        if snap is None:
            return None
        out = snap.to_dict()
        out["engine"] = self.engine_index
        return out


def run_engine_core(config: EngineConfig, engine_index: int, input_address: str, output_address: str,
                    parent_alive: Connection | None, num_threads: int | None = None) -> None:
    """Entry point of an engine process (a ``multiprocessing`` spawn target).

    Says HELLO as soon as its sockets are connected, builds the engine (model, KV cache), then says READY (or
    FAILED with the traceback) and serves until SHUTDOWN, SIGTERM, or the API process going away. A loop that
    raises says DEAD with the reason before the process exits with status 1.
    """
    # Ctrl-C reaches the whole process group: the API process decides when engines stop. (A Ray actor, which has
    # no parent pipe, may run its call off the main thread: Ray then owns the signals.)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _raise_system_exit)
    if parent_alive is not None:
        # A SIGKILLed API process cannot remove its socket folder: the engine that outlives it does.
        exit_with_parent(parent_alive, f"engine {engine_index}", "the API process",
                         on_exit=lambda: remove_ipc_dir(input_address))
    if num_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(num_threads)  # before torch starts its pool
        import torch

        torch.set_num_threads(num_threads)
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.DEALER)
    input_socket.setsockopt(zmq.IDENTITY, identity_of(engine_index))
    input_socket.setsockopt(zmq.LINGER, 0)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 5000)  # a DEAD message must get out before the process exits
    output_socket.connect(output_address)
    input_socket.send_multipart([EngineMessageType.HELLO.value, encode(Hello(engine_index, os.getpid()))])
    try:
        proc = EngineCoreProc(config, engine_index, input_socket, output_socket)
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which fails its start-up
        logger.exception("engine %d failed to start", engine_index)
        input_socket.send_multipart([EngineMessageType.FAILED.value,
                                     encode(Failure(engine_index, _describe(e)))])
        output_socket.close()
        input_socket.close(linger=2000)
        ctx.term()
        raise SystemExit(1) from None
    input_socket.send_multipart([EngineMessageType.READY.value, encode(proc.ready_message())])
    logger.info("engine %d (pid %d) ready: %d KV blocks", engine_index, os.getpid(),
                proc.core.kv_cache_layout.num_blocks)
    status = 0
    try:
        proc.run()
    except SystemExit:
        logger.info("engine %d: stopping (SIGTERM)", engine_index)
    except BaseException as e:  # noqa: BLE001 - any failure ends this engine; the API process must know why
        logger.exception("engine %d: the engine loop died", engine_index)
        output_socket.send_multipart([EngineMessageType.DEAD.value, encode(Failure(engine_index, _describe(e)))])
        status = 1
    finally:
        proc.log_boundary_cost()
        proc.core.close()
        input_socket.close()
        output_socket.close()
        ctx.term()
    if status:
        raise SystemExit(status)


#: The prefix of the private folder holding the engine sockets' ipc:// files (``EngineCoreClient`` makes it).
IPC_DIR_PREFIX = "pagedllm-engine-"


def remove_ipc_dir(address: str) -> None:
    """Remove the private socket folder of an ``ipc://`` address; any other address or folder is left alone."""
    if not address.startswith("ipc://"):
        return
    folder = os.path.dirname(address[len("ipc://"):])
    if os.path.basename(folder).startswith(IPC_DIR_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)
