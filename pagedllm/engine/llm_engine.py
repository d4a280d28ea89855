"""The synchronous engine behind the offline ``LLM`` class: front end and engine core in one loop."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.front_end import EngineFrontEnd
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor
from pagedllm.engine_args import EngineArgs
from pagedllm.logger import init_logger
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class LLMEngine(EngineFrontEnd):
    """The front end and the engine core in one thread: ``step()`` runs the model."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.model_executor.loader import load_tokenizer

        self.tokenizer = load_tokenizer(config.model)
        self.core = EngineCore(config)
        self.config = config = self.core.config  # resolved with the KV cache layout
        self.structured_output = self.core.attach_structured_outputs(self.tokenizer)
        self.processor = Processor(config.model, self.tokenizer, config.scheduler.max_model_len,
                                   self.core.scheduler.check_fits, config.scheduler)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Async output processing (GPU): a step's outputs are detokenized and handed out while the device
        # computes the next step, instead of between the two. Off on CPUs, where the host is the device.
        on_accelerator = self.core.executor.platform.is_accelerator
        self.async_output = on_accelerator and not config.device.disable_async_output_proc
        if on_accelerator:
            logger.info("async output processing: %s", "on (outputs are detokenized while the GPU runs the next "
                        "step)" if self.async_output else "off (--disable-async-output-proc)")
        self._unprocessed: list[EngineCoreOutput] = []  # the last step's outputs, when async_output

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def _queue(self, requests: list[Request]) -> None:
        for request in requests:
            self.core.add_request(request)

    def _precompile(self, params: SamplingParams) -> None:
        future = self.structured_output.compile(params.structured_outputs)  # starts it; never waits
        if future.done() and future.exception() is not None:
            raise future.exception()

    def abort_children(self, child_ids: list[str]) -> None:
        self.core.abort_requests(child_ids)

    def _finish_stopped(self, child_ids: list[str]) -> None:
        self.core.finish_stopped(child_ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        if not self.async_output:
            return self._process(self.core.step())
        earlier, self._unprocessed = self._unprocessed, []
        results: list[RequestOutput | PoolingRequestOutput] = []
        errors: list[BaseException] = []

        def process_earlier() -> None:
            # The previous step's outputs, while the device runs this one. A request that hit a stop string
            # there was already scheduled again: that step's token for it is dropped (it has no parent).
            try:
                results.extend(self._process(earlier))
            except BaseException as e:  # noqa: BLE001 - raised below, not blamed on the model step
                errors.append(e)

        outputs = self.core.step(overlap=process_earlier)
        if errors:
            raise errors[0]
        if self.core.has_unfinished_requests():
            self._unprocessed = outputs
        else:  # no step follows to hide them behind: hand them out now
            results.extend(self._process(outputs))
        return results

    def has_unfinished_requests(self) -> bool:
        # Requests only: blocks a KV connector holds for a reader are polled by the next steps, not waited for.
        return self.core.scheduler.has_unfinished_requests() or bool(self._unprocessed)

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def take_stats(self) -> list[SchedulerStats]:
        """The engine core's counters now (``core/scheduler_stats.py``), for the metrics room."""
        return [self.core.take_stats()]

    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Run one of the engine's named utilities (``UTILITIES``) now; a done future, as the multiprocess
        engine's (``MultiprocEngine.call_utility``) would be once its engines answer."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            if method not in UTILITIES:
                raise ValueError(f"method: {method!r} is not an engine utility; known: {sorted(UTILITIES)}")
            future.set_result(getattr(self, method)(*args))
        except Exception as e:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(e)
        return future


# The named calls the front end may make into a running engine (between steps), here and in engine processes.
UTILITIES = frozenset({"reset_prefix_cache"})
