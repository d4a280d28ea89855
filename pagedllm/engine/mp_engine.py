"""``MultiprocEngine``: the engine front end over engine-core processes (``pagedllm serve``'s default).

The API process keeps tokenizing, the chat template, detokenizing, stop strings and metrics; each engine process
(``engine/core_proc.py``) keeps a scheduler, a KV cache and a model. With ``--data-parallel-size N`` there are N
of them and every request goes to one, chosen by the router (``engine/router.py``) from the engines' loads and,
by default, from which engine already caches the longest part of its prompt.

It has ``LLMEngine``'s interface, so ``AsyncLLM`` drives either. All of it runs on ``AsyncLLM``'s output thread
(ZMQ sockets are not thread-safe); ``wake()`` and the death watcher are the only calls from other threads.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagedllm.config import EngineConfig, KVCacheLayout
from pagedllm.core.request import Request
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import check_prompt_fits
from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.core_messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineMessageType,
    Ready,
    RequestType,
    UtilityCall,
)
from pagedllm.engine.encoder_inputs import pack_encoder_input
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.front_end import EngineFrontEnd
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor
from pagedllm.logger import init_logger
from pagedllm.multimodal.wire import pack_mm_features
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.utils import physical_cpu_cores

logger = init_logger(__name__)

# With requests in flight, ``step`` waits this long at most for an engine's message (it wakes on any message,
# a new command or an engine's death at once).
_STEP_POLL_MS = 100


@dataclass
class _PendingUtility:
    method: str
    future: concurrent.futures.Future
    results: dict[int, Any] = field(default_factory=dict)
    error: str | None = None


class KVCacheSnapshots:
    """Every engine's block map for ``GET /v1/kv_cache/snapshot``: engine 0's at the top level (the single-engine
    shape), and the list of all under ``engines``."""

    def __init__(self, snapshots: list[dict]) -> None:
        import json

        body = dict(snapshots[0])
        body["engines"] = snapshots
        self.json_bytes = json.dumps(body, separators=(",", ":")).encode()


class MultiprocEngine(EngineFrontEnd):
    """``config`` is the config the engines were started with until they are READY, then that config resolved
    with their KV cache layout (``kv_cache_layout``: the smallest block count of all engines)."""

    builds_own_snapshots = True  # each engine process builds its own (``kv_cache_snapshots``)

    def __init__(self, config: EngineConfig, engine_target: Callable[..., None] | None = None) -> None:
        """``engine_target``: the engine processes' entry point, if not ``run_engine_core`` (fault tests)."""
        from pagedllm.engine.dp_router import DataParallelRouter
        from pagedllm.model_executor.loader import load_tokenizer

        self.config = config
        parallel = config.parallel
        self.num_engines = n = parallel.data_parallel_size
        self.tokenizer = load_tokenizer(config.model)
        threads = _threads_per_engine(n)
        if n > 1:
            logger.info("data parallel: %d engine processes, %s CPU threads each, %s routing", n,
                        threads if threads is not None else "default", parallel.routing)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wakeup: Callable[[], None] | None = None
        self.router = DataParallelRouter(config, n)
        self.config = config = self.router.config  # with the hashes and event endpoints routing needs
        self.client = EngineCoreClient(config, n, threads, on_death=self._on_death,
                                       **({"target": engine_target} if engine_target else {}))
        try:
            self.router.start()
            self.kv_cache_layout = layout_from_ready(self.client.ready)
            self.config = config = config.with_kv_cache_layout(self.kv_cache_layout)
            self.structured_output = StructuredOutputManager(self.tokenizer, config.model.vocab_size,
                                                             config.model.eos_token_ids)  # validation only
            self.processor = Processor(config.model, self.tokenizer, config.scheduler.max_model_len,
                                       self._check_fits, config.scheduler)
        except BaseException:
            self.client.shutdown()
            self.router.close()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self._owner: dict[str, int] = {}  # engine request (child) id -> the engine that runs it
        self._parent_of: dict[str, str] = {}  # child id -> the request id the router knows it by
        self._live_children: dict[str, int] = {}  # request id -> its samples still running
        self._reported_load = [0] * n  # each engine's running + waiting at its last report
        self._sent_since_report = [0] * n
        self._stats: list[SchedulerStats] = []
        self._undelivered: list[EngineCoreOutput] = []
        self._utilities: dict[int, _PendingUtility] = {}
        self._next_call_id = 0
        # The price of the boundary on this side: receiving and decoding the engines' messages.
        self.num_messages = 0
        self.message_time_s = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self.client.output, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _check_fits(self, num_prompt_tokens: int, pooling: bool = False) -> None:
        check_prompt_fits(self.config.scheduler, self.kv_cache_layout.num_blocks - 1, self.config.cache.block_size,
                          num_prompt_tokens, pooling)

    @property
    def pids(self) -> list[int]:
        return self.client.pids

    # ---- threads ---------------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Any thread: make a waiting ``step`` return (a command was queued)."""
        if self._wake_w < 0:  # shut down: the descriptor number may belong to another file by now
            return
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # the pipe is full (a wake-up is pending anyway) or closed
            pass

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        """``fn`` wakes the owner's idle loop when an engine dies (AsyncLLM: notify its condition)."""
        self._wakeup = fn

    def _on_death(self, index: int, reason: str) -> None:  # the watcher thread
        self.wake()
        if self._wakeup is not None:
            self._wakeup()

    def _raise_if_dead(self) -> None:
        if self.client.dead is not None:
            raise EngineDeadError(f"{self.client.dead[1]}; restart the server")

    # ---- requests --------------------------------------------------------------------------------------------
    def _queue(self, requests: list[Request]) -> None:
        self._raise_if_dead()
        first = requests[0]
        # Every sample of one request goes to one engine: they share the prompt's blocks there.
        parent = _parent_id(first.request_id, len(requests))
        loads = [r + s for r, s in zip(self._reported_load, self._sent_since_report)]
        engine = self.router.choose(parent, first.prompt_token_ids, first.cache_salt, loads, first.block_keys)
        encoder_input, encoder_shape = pack_encoder_input(first.encoder_input)
        mm_features = pack_mm_features(first.mm_features)
        for request in requests:
            self._send(engine, RequestType.ADD, EngineCoreRequest(
                request.request_id, request.prompt_token_ids, request.sampling_params, list(request.eos_token_ids),
                request.max_tokens, request.arrival_time, request.cache_salt, request.pooling_params,
                encoder_input, encoder_shape, mm_features, request.lora))
            self._owner[request.request_id] = engine
            self._parent_of[request.request_id] = parent
        self._live_children[parent] = len(requests)
        self._sent_since_report[engine] += len(requests)

    def _send(self, engine: int, kind: RequestType, message: Any) -> None:
        try:
            self.client.send(engine, kind, message)
        except zmq.ZMQError as e:  # the engine's socket is gone: it died, and the watcher will say how
            raise EngineDeadError(f"engine {engine} is unreachable ({e}); restart the server") from None

    def abort_children(self, child_ids: list[str]) -> None:
        self._send_aborts(child_ids, "abort")

    def _finish_stopped(self, child_ids: list[str]) -> None:
        self._send_aborts(child_ids, "stop")

    def _send_aborts(self, child_ids: list[str], reason: str) -> None:
        by_engine: dict[int, list[str]] = {}
        for child_id in child_ids:
            engine = self._forget(child_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(child_id)
        if self.client.dead is not None:
            return
        for engine, ids in by_engine.items():
            self._send(engine, RequestType.ABORT, AbortRequests(ids, reason))

    def _forget(self, child_id: str) -> int | None:
        engine = self._owner.pop(child_id, None)
        parent = self._parent_of.pop(child_id, None)
        if parent is not None:
            left = self._live_children.pop(parent, 1) - 1
            if left > 0:
                self._live_children[parent] = left
            else:
                self.router.request_finished(parent)
        return engine

    # ---- utilities -------------------------------------------------------------------------------------------
    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Call a named utility on every engine; the future gets the combined result (``_combine``)."""
        self._raise_if_dead()
        self._next_call_id += 1
        call_id = self._next_call_id
        pending = _PendingUtility(method, concurrent.futures.Future())
        self._utilities[call_id] = pending
        for engine in range(self.num_engines):
            self._send(engine, RequestType.UTILITY, UtilityCall(call_id, method, list(args)))
        return pending.future

    def kv_cache_snapshots(self) -> concurrent.futures.Future:
        return self.call_utility("kv_cache_snapshot")

    def _on_utility_result(self, engine: int, message: EngineCoreOutputs) -> None:
        result = message.utility_result
        pending = self._utilities.get(result.call_id)
        if pending is None:
            return
        pending.results[engine] = result.result
        pending.error = pending.error or result.error
        if len(pending.results) < self.num_engines:
            return
        del self._utilities[result.call_id]
        if pending.error is not None:
            pending.future.set_exception(RuntimeError(pending.error))
        else:
            pending.future.set_result(_combine(pending.method, [pending.results[i] for i in range(self.num_engines)]))

    # ---- the loop --------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._owner or self._utilities or self._undelivered) or self.client.dead is not None

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Wait (briefly) for the engines' next messages and turn them into request outputs."""
        self._raise_if_dead()
        if not self._undelivered:
            ready = dict(self._poller.poll(_STEP_POLL_MS))
            if self._wake_r in ready:
                _drain_pipe(self._wake_r)
        self._receive()
        outputs, self._undelivered = self._undelivered, []
        return self._process(outputs)

    def _receive(self) -> None:
        self.router.poll_events()
        start = time.perf_counter()
        messages = self.client.recv_outputs()
        if messages:
            self.num_messages += len(messages)
            self.message_time_s += time.perf_counter() - start
        for kind, message in messages:
            if kind is EngineMessageType.DEAD:
                self.client.report_dead_message(message.engine_index, message.reason)
                self._raise_if_dead()
            if kind is not EngineMessageType.OUTPUTS:
                continue
            engine = message.engine_index
            if message.scheduler_stats is not None:
                self._stats.append(message.scheduler_stats)
                self._reported_load[engine] = message.scheduler_stats.load
                self._sent_since_report[engine] = 0
            if message.utility_result is not None:
                self._on_utility_result(engine, message)
            for out in message.outputs:
                if out.pooling_output is not None:
                    out.pooling_output = _tensor_from_bytes(out.pooling_output)
                if out.finished:
                    self._forget(out.req_id)
                self._undelivered.append(out)
        self._raise_if_dead()

    def take_stats(self) -> list[SchedulerStats]:
        """The engines' reports since the last call (reading any that wait, so an idle server's gauges move)."""
        if self.client.dead is None:
            self._receive()
        stats, self._stats = self._stats, []
        return stats

    def shutdown(self) -> None:
        if self.num_messages:
            logger.info("received %d engine messages, %.1f us each to receive and decode (mean)", self.num_messages,
                        self.message_time_s / self.num_messages * 1e6)
            self.num_messages = 0
        self.client.shutdown()
        self.router.close()
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def layout_from_ready(ready: list[Ready]) -> KVCacheLayout:
    """The KV cache layout the API side checks prompts against: engine 0's, with the fewest blocks of any engine
    (a prompt must fit wherever the router sends it)."""
    first = ready[0]
    return KVCacheLayout(num_blocks=min(r.num_blocks for r in ready), device=first.device,
                         sliding_window=first.sliding_window, sliding_group_window=first.sliding_group_window,
                         sliding_group_num_blocks=first.sliding_group_num_blocks,
                         cross_group_num_blocks=first.cross_group_num_blocks)


def _combine(method: str, results: list[Any]) -> Any:
    """One answer from every engine's: counts add up, snapshots are listed per engine."""
    if method == "reset_prefix_cache":
        return sum(int(r or 0) for r in results)
    if method == "kv_cache_snapshot":
        return None if any(r is None for r in results) else KVCacheSnapshots(results)
    return results


def _parent_id(child_id: str, n: int) -> str:
    """``child_request_id``'s inverse: the request id the samples of an ``n > 1`` request share."""
    return child_id if n == 1 else child_id.split("_", 1)[1]


def _threads_per_engine(num_engines: int) -> int | None:
    """The host's cores split between the engines (at least one each); None with one engine (its own default)."""
    if num_engines == 1:
        return None
    return max(1, physical_cpu_cores() // num_engines)


def _tensor_from_bytes(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.float32)


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass
