"""The API side of an engine, whatever runs its core: prompts in, detokenized outputs out.

``EngineFrontEnd`` tokenizes and validates a prompt into engine-core ``Request``s, keeps one detokenizer per
sequence, finds stop strings and builds ``RequestOutput``s. Its subclasses decide where the core runs:
``LLMEngine`` (in this thread) and ``MultiprocEngine`` (engine-core processes behind ZMQ).
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.client import EngineClient
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager


class EngineFrontEnd(EngineClient):
    """Subclasses set ``config``, ``tokenizer``, ``processor``, ``output_processor`` and ``structured_output``,
    and implement ``_queue``, ``abort_children`` and ``_finish_stopped``."""

    config: EngineConfig
    tokenizer: Any
    processor: Processor
    output_processor: OutputProcessor
    structured_output: StructuredOutputManager

    # ---- where the core runs (subclasses) ------------------------------------------------------------------
    def _queue(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def abort_children(self, child_ids: list[str]) -> None:
        raise NotImplementedError

    def _finish_stopped(self, child_ids: list[str]) -> None:
        raise NotImplementedError

    def _precompile(self, params: SamplingParams) -> None:
        """Start compiling a request's grammar early (where the core can use the result)."""

    # ---- the front end ------------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, kind: OutputKind = OutputKind.FINAL_ONLY,
                    cache_salt: str | None = None, add_special_tokens: bool = True, lora_request: Any = None) -> None:
        """Validate and queue a request; raises ValueError naming the bad field. ``lora_request``: a
        ``LoRARequest`` (or a checked ``AdapterRef``) to run the request with, on an engine started with LoRA."""
        if request_id in self.output_processor.parents or request_id in self.output_processor.pooling:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        arrival_time = arrival_time if arrival_time is not None else time.time()
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = str(prompt["cache_salt"])  # vLLM's place for it in offline prompts
        if isinstance(params, PoolingParams) != self.config.model.is_pooling:
            raise ValueError(_wrong_runner_message(self.config.model.name, self.config.model.is_pooling))
        encoder_input = self.processor.encoder_input(prompt)  # audio_features (Whisper), else None
        if isinstance(params, PoolingParams):
            if isinstance(prompt, dict) and (prompt.get("multi_modal_data") or prompt.get("mm_features")):
                raise ValueError("multi_modal_data: pooling (embedding) requests take text only")
            text, token_ids = self.processor.tokenize_for_pooling(prompt, params, add_special_tokens)
            request = self.processor.make_pooling_request(request_id, token_ids, params, arrival_time)
            self.output_processor.add_pooling_request(request_id, text, token_ids, arrival_time)
            self._queue([request])
            return
        adapter = self.resolve_lora(lora_request) if lora_request is not None else None
        if params.structured_outputs is not None:
            self._precompile(params)
        multimodal = self.processor.multimodal_inputs(prompt, add_special_tokens)  # images: the HF processor
        if multimodal is not None:
            text, token_ids, mm_features = multimodal
        else:
            (text, token_ids), mm_features = self.processor.tokenize(prompt, add_special_tokens), None
        requests = self.processor.make_requests(request_id, token_ids, params, arrival_time, cache_salt,
                                                encoder_input, mm_features, adapter)
        self.output_processor.add_request(request_id, text, token_ids, params, kind, arrival_time)
        self._queue(requests)

    def resolve_lora(self, lora_request: Any) -> Any:
        """The checked ``AdapterRef`` of a ``LoRARequest`` (ValueError naming the field when the engine runs no
        adapters or the adapter cannot be applied to its model)."""
        if self.config.lora is None:
            raise ValueError("lora_request: this engine was started without LoRA; start it with enable_lora=True "
                             "(--enable-lora)")
        resolver = getattr(self, "_lora_resolver", None)
        if resolver is None:
            from pagedllm.lora.resolver import AdapterResolver

            resolver = self._lora_resolver = AdapterResolver(self.config.model.hf_config,
                                                             self.config.lora.max_lora_rank)
        return resolver.resolve(lora_request)

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
            self.abort_children(children)

    def finish_aborted(self, request_ids: list[str]) -> list[RequestOutput | PoolingRequestOutput]:
        outputs = []
        for request_id in request_ids:
            children = self.output_processor.child_ids(request_id)
            out = self.output_processor.make_abort_output(request_id)  # before its state is dropped
            self.abort_children(children)
            if out is not None:
                outputs.append(out)
        return outputs

    def _process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput | PoolingRequestOutput]:
        """Detokenize, apply stop strings, build the RequestOutputs."""
        if not outputs:
            return []
        request_outputs, to_stop = self.output_processor.process_outputs(outputs)
        if to_stop:
            self._finish_stopped(to_stop)
        return request_outputs


def _wrong_runner_message(model: str, is_pooling: bool) -> str:
    if is_pooling:
        return (f"model: {model!r} runs the pooling runner (embeddings), which cannot generate text; use "
                "LLM.embed or /v1/embeddings, or start it with --runner generate if it is a decoder")
    return (f"model: {model!r} runs the generate runner; embeddings need a pooling model or "
            "--runner pooling (LLM(model, runner='pooling'))")
