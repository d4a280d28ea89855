"""The synchronous engine behind the offline ``LLM`` class: front end and engine core in one loop."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine_args import EngineArgs
from pagedllm.logger import init_logger
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.model_executor.loader import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.core = EngineCore(config)
        on_gpu = self.core.worker.device.type == "cuda"  # the resolved device ("auto" included)
        # On a GPU the host is idle while the forward runs: fill the grammar bitmask then, whatever the core count.
        self.structured_output = StructuredOutputManager(self.tokenizer, config.model.vocab_size,
                                                         config.model.eos_token_ids,
                                                         overlap_fill=True if on_gpu else None)
        self.core.structured_output = self.structured_output
        self.processor = Processor(config.model, self.tokenizer, config.scheduler.max_model_len,
                                   self.core.scheduler.check_fits)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Async output processing (GPU): a step's outputs are detokenized and handed out while the device
        # computes the next step, instead of between the two. Off on CPUs, where the host is the device.
        self.async_output = on_gpu and not config.device.disable_async_output_proc
        if on_gpu:
            logger.info("async output processing: %s", "on (outputs are detokenized while the GPU runs the next "
                        "step)" if self.async_output else "off (--disable-async-output-proc)")
        self._unprocessed: list[EngineCoreOutput] = []  # the last step's outputs, when async_output

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, kind: OutputKind = OutputKind.FINAL_ONLY,
                    cache_salt: str | None = None, add_special_tokens: bool = True) -> None:
        """Validate and queue a request; raises ValueError naming the bad field."""
        if request_id in self.output_processor.parents or request_id in self.output_processor.pooling:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        arrival_time = arrival_time if arrival_time is not None else time.time()
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = str(prompt["cache_salt"])  # vLLM's place for it in offline prompts
        if isinstance(params, PoolingParams) != self.config.model.is_pooling:
            raise ValueError(_wrong_runner_message(self.config.model.name, self.config.model.is_pooling))
        if isinstance(params, PoolingParams):
            text, token_ids = self.processor.tokenize_for_pooling(prompt, params, add_special_tokens)
            request = self.processor.make_pooling_request(request_id, token_ids, params, arrival_time)
            self.output_processor.add_pooling_request(request_id, text, token_ids, arrival_time)
            self.core.add_request(request)
            return
        if params.structured_outputs is not None:
            future = self.structured_output.compile(params.structured_outputs)  # starts it; never waits
            if future.done() and future.exception() is not None:
                raise future.exception()
        text, token_ids = self.processor.tokenize(prompt, add_special_tokens)
        requests = self.processor.make_requests(request_id, token_ids, params, arrival_time, cache_salt)
        self.output_processor.add_request(request_id, text, token_ids, params, kind, arrival_time)
        for request in requests:
            self.core.add_request(request)

    def validate_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar (or find it cached); ValueError naming the field if it cannot be.

        Blocks the calling thread, so callers run it off the engine loop (AsyncLLM: in a worker thread).
        """
        if getattr(params, "structured_outputs", None) is not None:  # pooling params have none
            self.structured_output.validate(params.structured_outputs)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            children = self.output_processor.child_ids(request_id)
            self.output_processor.abort(request_id)
            self.core.abort_requests(children)

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

    def _process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput | PoolingRequestOutput]:
        """Detokenize, apply stop strings, build the RequestOutputs."""
        if not outputs:
            return []
        request_outputs, to_stop = self.output_processor.process_outputs(outputs)
        if to_stop:
            self.core.finish_stopped(to_stop)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._unprocessed)

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()


def _wrong_runner_message(model: str, is_pooling: bool) -> str:
    if is_pooling:
        return (f"model: {model!r} runs the pooling runner (embeddings), which cannot generate text; use "
                "LLM.embed or /v1/embeddings, or start it with --runner generate if it is a decoder")
    return (f"model: {model!r} runs the generate runner; embeddings need a pooling model or "
            "--runner pooling (LLM(model, runner='pooling'))")
