"""``AsyncLLM``: one asyncio stream of outputs per request, fed by an output thread that drives the engine.

The engine is an ``LLMEngine`` (its core runs on that thread: ``PAGEDLLM_ENABLE_MULTIPROCESSING=0``, tests) or a
``MultiprocEngine`` (the server's default: the thread tokenizes, detokenizes and moves messages while the
engine cores run in their own processes). Neither is thread-safe, so only that thread touches it. The asyncio
side talks to it through a command queue (add / abort / utility call) and gets outputs back through
``loop.call_soon_threadsafe``; neither side ever waits on the other while holding anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.engine.client import EngineClient, StepStatsLogger
from pagedllm.engine.engine_snapshot import EngineSnapshot, SnapshotPublisher
from pagedllm.engine.errors import EngineDeadError, RequestFailedError
from pagedllm.engine.output_processor import OutputKind
from pagedllm.engine.processor import PromptType
from pagedllm.logger import init_logger
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine_args import EngineArgs

logger = init_logger(__name__)

# How long the idle engine thread sleeps between checks that it should log stats or stop.
_IDLE_WAIT_S = 1.0


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Stream:
    """Per-request output queue living on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


class AsyncLLM:
    """Serve many concurrent requests from one engine running in a background thread.

    ``engine`` is an ``EngineClient`` (``engine/client.py``): an ``LLMEngine`` or a ``MultiprocEngine``.
    ``stat_logger`` (optional) gets ``record_step(engine, outputs, t)`` after every step and
    ``maybe_log(engine, now)`` from the loop.
    """

    def __init__(self, engine: EngineClient, stat_logger: StepStatsLogger | None = None) -> None:
        self.engine = engine
        self.stat_logger = stat_logger
        self._streams: dict[str, _Stream] = {}
        self._commands: list[_Command] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.errored: BaseException | None = None
        self._exited = False  # set under _cond when the thread returns, so no command is left hanging
        self.snapshots = SnapshotPublisher()  # the cache map's view of an in-thread engine (playground)
        # Engine cores in other processes build their own snapshots, and wake this loop when they die.
        self._remote = engine.builds_own_snapshots
        engine.set_wakeup(self._notify)
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_logger: StepStatsLogger | None = None) -> AsyncLLM:
        """Engine cores in their own processes, unless ``PAGEDLLM_ENABLE_MULTIPROCESSING=0`` (``pagedllm/envs.py``)."""
        from pagedllm import envs

        config = args.create_engine_config()
        if envs.PAGEDLLM_ENABLE_MULTIPROCESSING:
            from pagedllm.engine.mp_engine import MultiprocEngine

            return cls(MultiprocEngine(config), stat_logger)
        if config.parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size: more than one engine needs engine processes; unset "
                             "PAGEDLLM_ENABLE_MULTIPROCESSING=0")
        from pagedllm.engine.llm_engine import LLMEngine

        logger.info("engine core on a thread of the API process (PAGEDLLM_ENABLE_MULTIPROCESSING=0)")
        return cls(LLMEngine(config), stat_logger)

    # ---- state ---------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.errored is None and not self._stopping

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"The engine loop has died ({self.errored!r}); restart the server.")

    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not engine.has_unfinished_requests() and not self._remote:
                    self.snapshots.flush(engine)  # the idle state, before waiting
                with self._cond:
                    while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                        self._cond.wait(_IDLE_WAIT_S)
                        if self.stat_logger is not None:
                            # An engine in its own process reports an abort's freed blocks after the abort
                            # command ran here: read its late reports each wake, not only when a log line is due.
                            now = time.time()
                            self.stat_logger.record_step(engine, [], now)
                            self.stat_logger.maybe_log(engine, now)
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for cmd in commands:
                    # A caller that gave up (cancelled) before we got here: skip its command.
                    if not cmd.future.set_running_or_notify_cancel():
                        continue
                    try:
                        result = cmd.fn()
                    except Exception as e:  # a bad request must not kill the loop
                        cmd.future.set_exception(e)
                    else:
                        cmd.future.set_result(result)
                if commands and self.stat_logger is not None:
                    # An abort may have freed blocks with no step to follow; refresh the gauges now.
                    self.stat_logger.record_step(engine, [], time.time())
                if commands and not self._remote:
                    self.snapshots.after_step(engine, None)
                if stopping and not engine.has_unfinished_requests():
                    return
                if engine.has_unfinished_requests():
                    step_start = time.perf_counter()
                    outputs = engine.step()
                    step_time = time.perf_counter() - step_start
                    if self.stat_logger is not None:
                        now = time.time()
                        self.stat_logger.record_step(engine, outputs, now)
                        self.stat_logger.maybe_log(engine, now)
                    if outputs:
                        self._deliver(outputs)
                    if not self._remote:
                        self.snapshots.after_step(engine, step_time)  # after delivery: never delays tokens
        except BaseException as e:  # noqa: BLE001 - any failure means the loop is gone
            logger.exception("engine loop died")
            self.errored = e
            self._fail_everything()
        finally:
            with self._cond:
                self._exited = True
                commands, self._commands = self._commands, []
            for cmd in commands:
                if not cmd.future.done():
                    cmd.future.set_exception(EngineDeadError("The engine loop has stopped."))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # Group per event loop so a step costs one cross-thread wake-up, not one per request.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
                if out.finished:
                    self._streams.pop(out.request_id, None)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed; nobody is listening
                pass

    def _fail_everything(self) -> None:
        err = self.dead_error
        with self._cond:
            commands, self._commands = self._commands, []
        for cmd in commands:
            if not cmd.future.done():
                cmd.future.set_exception(err)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
            except RuntimeError:
                pass

    # ---- commands ------------------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        cmd = _Command(fn)
        with self._cond:
            if self.errored is not None or self._exited:
                cmd.future.set_exception(self.dead_error if self.errored else
                                         EngineDeadError("The engine loop has stopped."))
                return cmd.future
            self._commands.append(cmd)
            self._cond.notify()
        self.engine.wake()  # the loop may be waiting on the engines' sockets rather than on _cond
        return cmd.future

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call a named engine utility (``reset_prefix_cache``, ...) between steps, on every engine."""
        future = await asyncio.wrap_future(self._submit(lambda: self.engine.call_utility(method, *args)))
        return await asyncio.wrap_future(future)

    async def kv_cache_snapshot(self) -> EngineSnapshot | Any | None:
        """The latest published engine snapshot (KV blocks, counters); asks the loop for a fresh one when
        the latest is missing or out of date. None if the engine cannot build one. Engine processes build
        their own (one per engine); the answer then lists them all."""
        if self._remote:
            future = await asyncio.wrap_future(self._submit(self.engine.kv_cache_snapshots))
            return await asyncio.wrap_future(future)
        self.snapshots.watch()
        if self.snapshots.is_stale():
            return await asyncio.wrap_future(self._submit(lambda: self.snapshots.publish(self.engine)))
        return self.snapshots.latest

    # ---- the per-request stream ------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       kind: OutputKind = OutputKind.DELTA, cache_salt: str | None = None,
                       add_special_tokens: bool = True, arrival_time: float | None = None,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes.

        Validation errors (ValueError) are raised by the first ``__anext__`` before any output. Leaving
        the iteration early (client gone, task cancelled) aborts the request and frees its KV blocks.
        """
        if self.errored is not None:
            raise self.dead_error
        if self._stopping:
            raise EngineDeadError("The server is shutting down.")
        stream = _Stream(asyncio.get_running_loop())
        arrival_time = arrival_time if arrival_time is not None else time.time()

        def add() -> None:
            adapter = {"lora_request": lora_request} if lora_request is not None else {}
            self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time, kind=kind,
                                    cache_salt=cache_salt, add_special_tokens=add_special_tokens, **adapter)
            # Registered on the engine thread, so no output can be produced before the stream exists.
            self._streams[request_id] = stream
            if self.stat_logger is not None and not isinstance(params, PoolingParams):
                self.stat_logger.add_request(request_id, kind, params.n)

        structured = getattr(params, "structured_outputs", None)  # pooling params have none
        if structured is not None:
            # Compile here, off the engine loop: a bad schema is a ValueError before anything is queued,
            # and the engine then finds the grammar cached.
            await asyncio.to_thread(self.engine.validate_structured_outputs, params)
        added = self._submit(add)
        finished = False
        try:
            await asyncio.wrap_future(added)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished and _failed(item):
                    raise RequestFailedError(f"The model failed while computing request {request_id}; "
                                             "the server keeps serving other requests.")
                yield item
                if finished:
                    return
        finally:
            # The one place a request is aborted from the front end: any exit before it finished,
            # including a cancellation while the add was still queued (the abort is queued after it).
            rejected = added.done() and not added.cancelled() and added.exception() is not None
            if not finished and not rejected:
                if self.errored is None:
                    self._submit(lambda: self._abort_in_engine([request_id]))

    async def encode(self, prompt: PromptType, params: PoolingParams, request_id: str,
                     add_special_tokens: bool = True) -> PoolingRequestOutput:
        """Pool one prompt on a pooling model; ValueError for a bad input, as ``generate``."""
        out = None
        async for item in self.generate(prompt, params, request_id, kind=OutputKind.FINAL_ONLY,
                                        add_special_tokens=add_special_tokens):
            out = item
        if out is None or out.outputs is None:
            raise RequestFailedError(f"request {request_id} ended without an embedding")
        return out

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)  # here, after any queued add registered it
        self.engine.abort_request(request_ids)
        if self.stat_logger is not None:
            for request_id in request_ids:
                self.stat_logger.forget(request_id)

    # ---- shutdown ------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout`` s, abort the rest, stop."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(0.05)
        if self._thread.is_alive():
            def abort_all() -> None:
                self._abort_all_now()

            self._submit(abort_all)
            self._thread.join(10.0)
        if self.stat_logger is not None and self.errored is None:
            try:
                self.stat_logger.maybe_log(self.engine, time.time(), force=True)
            except Exception:  # noqa: BLE001 - the engines may be gone already; the last line is optional
                logger.debug("no final stats line", exc_info=True)
        self.engine.shutdown()

    def _abort_all_now(self) -> None:
        """Engine thread: end every in-flight request with finish_reason 'abort'."""
        request_ids = list(self._streams)
        outputs = self.engine.finish_aborted(request_ids)
        if self.stat_logger is not None:
            for request_id in request_ids:
                self.stat_logger.forget(request_id)
        if outputs:
            self._deliver(outputs)
        self._streams.clear()


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _failed(item: RequestOutput | PoolingRequestOutput) -> bool:
    if isinstance(item, PoolingRequestOutput):
        return item.finish_reason == "error"
    return any(c.finish_reason == "error" for c in item.outputs)
