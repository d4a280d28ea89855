"""The engine core: scheduler + executor, one ``step()`` per model forward. Pure busy-loop material."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.config import EngineConfig, KVCacheLayout
from pagedllm.core.kv_events import KVEventBatch
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_stats import SchedulerStats, make_scheduler_stats
from pagedllm.logger import init_logger
from pagedllm.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pagedllm.executor.base import Executor
    from pagedllm.worker.worker import Worker

logger = init_logger(__name__)


def is_fatal_device_error(exc: BaseException) -> bool:
    """A CUDA error (device-side assert, illegal address, launch failure ...) leaves the CUDA context broken:
    every later call fails too, so retrying requests one by one would only fail them all. Out-of-memory is not
    one of these (the allocator recovers)."""
    if getattr(exc, "fatal", False):  # e.g. a tensor-parallel rank died (executor/)
        return True
    text = str(exc)
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises CUDA errors as this
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return "out of memory" not in text
    return isinstance(exc, RuntimeError) and "CUDA error" in text and "out of memory" not in text


class EngineCore:
    """``engine_index``: this engine's data-parallel index (0 alone); it names its KV events endpoint and stats.

    Start-up sizes the KV cache: ``kv_cache_layout`` is what it resolved, and ``config`` is the given config
    resolved with it (``EngineConfig.with_kv_cache_layout``); the given one is never changed."""

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        from pagedllm.executor import make_executor

        self.executor: Executor = make_executor(config)  # one worker, or one per tensor-parallel rank
        self.kv_cache_layout: KVCacheLayout = self.executor.determine_kv_cache_layout()
        self.executor.init_kv_cache(self.kv_cache_layout)
        # The executor's config: the given one, or its copy with what tensor parallelism changes.
        self.config = config = self.executor.config.with_kv_cache_layout(self.kv_cache_layout)
        events = config.kv_events
        publishes = events is not None and events.publishes
        self.scheduler = Scheduler(config.scheduler, config.cache, enable_kv_cache_events=publishes)
        self.kv_connector = None  # the KV connector's scheduler half (--kv-transfer-config), else None
        if config.kv_transfer is not None:
            self._attach_kv_connector(config)
        self.kv_events = None  # a ZMQ publisher of this engine's KV cache events (--kv-events-config, routing)
        if publishes:
            from pagedllm.distributed.kv_events import make_event_publisher

            self.kv_events = make_event_publisher(events, engine_index)
            logger.info("engine %d publishes KV cache events at %s", engine_index, self.kv_events.endpoint)
        # Step statistics, read by the metrics room.
        self.num_steps = 0
        self.last_step_tokens = 0
        # Set by the engine that owns the tokenizer (LLMEngine); None = structured outputs unavailable.
        self.structured_output: StructuredOutputManager | None = None
        self._unscheduled: set[str] = set()  # added, not yet scheduled once (their queue time is pending)

    @property
    def worker(self) -> Worker:
        """This process's worker (tensor-parallel rank 0's): its runner, model and KV cache."""
        return self.executor.driver_worker

    def _attach_kv_connector(self, config: EngineConfig) -> None:
        from pagedllm.distributed.kv_transfer.factory import create_connector_pair

        kvt = config.kv_transfer
        if not self.executor.supports_kv_transfer:  # tensor-parallel ranks: checked before the connector opens
            raise ValueError("kv_transfer_config: KV transfer needs --tensor-parallel-size 1")
        scheduler_half, worker_half = create_connector_pair(kvt, config.cache.block_size)
        self.executor.attach_kv_connector(worker_half)
        scheduler_half.bind_worker(worker_half)
        self.scheduler.attach_kv_connector(scheduler_half)
        self.kv_connector = scheduler_half
        logger.info("engine %d: KV connector %s as %s (engine id %s)", self.engine_index, kvt.kv_connector,
                    kvt.kv_role, kvt.engine_id)

    def attach_structured_outputs(self, tokenizer: Any) -> StructuredOutputManager:
        """Give the core its grammar backend (it needs the tokenizer's vocabulary, which the core does not load)."""
        # On an accelerator the host is idle while the forward runs: fill the grammar bitmask then, whatever the
        # core count.
        mc = self.config.model
        overlap = True if self.executor.platform.is_accelerator else None
        self.structured_output = StructuredOutputManager(tokenizer, mc.vocab_size, mc.eos_token_ids,
                                                         overlap_fill=overlap)
        return self.structured_output

    def add_request(self, request: Request) -> None:
        self._unscheduled.add(request.request_id)
        params = request.sampling_params
        if getattr(params, "structured_outputs", None) is not None or getattr(params, "reasoning", None):
            if self.structured_output is None:  # (pooling requests have neither)
                raise ValueError("structured_outputs: this engine has no structured-output backend")
            self.scheduler.add_request(request)
            self.structured_output.add_request(request)  # WAITING_FOR_GRAMMAR until compiled
            return
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        """Requests the detokenizer ended on a stop string."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        # Held or arriving KV blocks need steps too: the connector reports transfers only when stepped.
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_kv_transfers()

    def step(self, overlap: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """One scheduled step. ``overlap`` runs exactly once: while the device computes the step when it
        samples (ModelRunner.execute_model), else after the step."""
        try:
            return self._step_once(overlap)
        finally:
            self._publish_kv_events()

    def _step_once(self, overlap: Callable[[], None] | None) -> list[EngineCoreOutput]:
        if overlap is None:
            return self._step(None)
        done = False

        def once() -> None:
            nonlocal done
            if not done:
                done = True
                overlap()

        try:
            return self._step(once)
        finally:
            once()

    def _step(self, overlap: Callable[[], None] | None) -> list[EngineCoreOutput]:
        so = self.structured_output
        grammar_errors = self._poll_grammars() if so is not None and so.has_waiting() else []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # Still tell the runner about finished requests so it drops their state (and a KV connector
            # reports its transfers).
            idle = self.executor.execute_model(sched)
            if so is not None and so.has_waiting() and not self.scheduler.running:
                so.poll(timeout=0.005)  # only grammars compiling: wait a moment instead of spinning
            elif self.scheduler.has_pending_kv_transfers() and not self.scheduler.running:
                time.sleep(0.005)  # only transfers in flight: poll them without spinning a core
            if not isinstance(idle, ModelRunnerOutput):  # a test's stand-in worker
                idle = ModelRunnerOutput(sampled_token_ids={})
            return grammar_errors + self.scheduler.update_from_output(sched, idle)
        if so is not None:
            so.fill_bitmask(sched, self.scheduler.requests)
        try:
            result = self.executor.execute_model(sched, overlap)
        except Exception as e:  # one bad request must not take the engine down; isolate it instead
            if getattr(e, "fatal", False):
                logger.critical("%s; the engine stops", e)
                raise
            if is_fatal_device_error(e):
                logger.critical("the GPU reported an error that breaks its context (%s); the engine stops, since "
                                "every later step would fail too: restart the server", e)
                raise
            logger.exception("model step failed with %d requests in the batch; running them one at a time "
                             "to find the one at fault", len(sched.num_scheduled_tokens))
            # Matchers have not moved: they advance only after a step succeeded.
            return grammar_errors + self.scheduler.recover_from_failed_step(sched)
        self.num_steps += 1
        self.last_step_tokens = sched.total_num_scheduled_tokens
        grammar_ended = so.accept_tokens(result) if so is not None else set()
        outputs = self.scheduler.update_from_output(sched, result)
        if so is not None:
            self._finish_ended_grammars(outputs, grammar_ended)
            so.remove_finished(self.scheduler.requests)
        return grammar_errors + outputs

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Release requests whose grammar compiled; fail those whose grammar did not compile."""
        assert self.structured_output is not None
        outputs = []
        for request, error in self.structured_output.poll():
            logger.warning("request %s: %s", request.request_id, error)
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error", stop_reason=error))
        return outputs

    def _finish_ended_grammars(self, outputs: list[EngineCoreOutput], ended: set[str]) -> None:
        """A request whose grammar terminated is done ("stop"), whatever its other stop rules say."""
        for out in outputs:
            if out.req_id in ended and not out.finished:
                self.scheduler.finish_requests([out.req_id], RequestStatus.FINISHED_STOPPED)
                out.finish_reason = "stop"

    def reset_prefix_cache(self) -> int:
        dropped = self.scheduler.kv.reset_prefix_cache()
        self._publish_kv_events()
        return dropped

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            events = self.scheduler.kv.take_events()
            if events:
                self.kv_events.publish(KVEventBatch(time.time(), events, self.engine_index))

    def close(self) -> None:
        """Release what outlives a step (the KV events socket, the tensor-parallel ranks, a KV connector)."""
        self.executor.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def take_stats(self) -> SchedulerStats:
        """The counters the front end reports (``core/scheduler_stats.py``), with the requests first scheduled
        since the last call."""
        newly: dict[str, tuple[float, float]] = {}
        if self._unscheduled:
            requests = self.scheduler.requests
            for request_id in list(self._unscheduled):
                request = requests.get(request_id)
                if request is None:
                    self._unscheduled.discard(request_id)
                elif request.first_scheduled_time is not None:
                    newly[request_id] = (request.first_scheduled_time,
                                         max(request.first_scheduled_time - request.arrival_time, 0.0))
                    self._unscheduled.discard(request_id)
        return make_scheduler_stats(self, self.engine_index, newly)
