"""Front-end input processing: prompt → validated token ids → engine-core Requests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedllm.config import ModelConfig, SchedulerConfig
from pagedllm.core.multimodal import MultiModalFeature, check_images_fit
from pagedllm.core.request import Request
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, max_model_len: int,
                 check_fits: Callable[..., None], scheduler_config: SchedulerConfig | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.check_fits = check_fits
        self.vocab_size = model_config.vocab_size
        self.scheduler_config = scheduler_config
        self._mm_processor: Any = None  # the model's HF processor (multimodal/processing.py), loaded at first use

    @property
    def mm_processor(self) -> Any:
        if self._mm_processor is None:
            from pagedllm.multimodal.processing import MultiModalProcessor

            self._mm_processor = MultiModalProcessor(self.model_config.model_path,
                                                     self.model_config.limit_mm_per_prompt)
        return self._mm_processor

    def multimodal_inputs(self, prompt: PromptType, add_special_tokens: bool = True
                          ) -> tuple[str, list[int], list[MultiModalFeature]] | None:
        """(text, token ids with image placeholders expanded, one feature per image) for a prompt with
        ``multi_modal_data`` ({"prompt": text with one <image> per image, "multi_modal_data": {"image": PIL images}},
        as vLLM takes it); None for a prompt without. ValueError naming the problem."""
        if isinstance(prompt, dict) and prompt.get("mm_features") is not None:
            return self._processed_multimodal(prompt)
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            return None
        mc = self.model_config
        if not mc.is_multimodal:
            raise ValueError(f"multi_modal_data: model {mc.name!r} ({mc.architecture}) takes text only; send images to "
                             "a vision-language model (see `pagedllm models`, INPUTS text+image)")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data: expected {'image': PIL image or list of them}")
        from pagedllm.multimodal.processing import as_image_list

        images = as_image_list(data.get("image", []))
        text = prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError("prompt: a prompt with multi_modal_data needs its text as 'prompt'")
        token_ids, features = self.mm_processor.process(text, images, add_special_tokens)
        if self.scheduler_config is not None:
            sc = self.scheduler_config
            check_images_fit(features, sc.max_num_batched_tokens, sc.encoder_cache_capacity)
        return text, token_ids, features

    def _processed_multimodal(self, prompt: dict) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """A prompt ``multimodal_inputs`` already processed (the chat endpoint does it off the event loop):
        {"prompt_token_ids": ..., "mm_features": ...}."""
        features = prompt["mm_features"]
        if not self.model_config.is_multimodal or not all(isinstance(f, MultiModalFeature) for f in features):
            raise ValueError("mm_features: only the server's own processed prompts carry them")
        _, token_ids = self.tokenize({"prompt_token_ids": prompt["prompt_token_ids"]})
        return prompt.get("prompt"), token_ids, list(features)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Accepts a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt: the token id list must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt: token ids must be integers")
            bad = [t for t in prompt if t < 0 or t >= self.vocab_size]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is out of range [0, {self.vocab_size})")
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")

    def encoder_input(self, prompt: PromptType) -> Any:
        """The prompt's ``audio_features`` as float32 [n_mels, 3000] for an encoder-decoder (Whisper) model, None for
        any other; ValueError naming the field when a Whisper prompt lacks it or a text model is sent one."""
        from pagedllm.engine.encoder_inputs import check_audio_features

        features = prompt.get("audio_features") if isinstance(prompt, dict) else None
        return check_audio_features(features, self.model_config)

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """Checks that need the model; returns the effective max_tokens."""
        params.verify_token_ids(self.vocab_size)
        self.check_fits(num_prompt_tokens)
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None, cache_salt: str | None = None,
                      encoder_input: Any = None, mm_features: list[MultiModalFeature] | None = None,
                      lora: Any = None) -> list[Request]:
        """One engine request per sample (n > 1 fans out; children share prompt blocks via the cache, and an
        encoder-decoder request's children its ``encoder_input``). ``lora``: the adapter (``AdapterRef``) or None."""
        max_tokens = self.validate_params(params, len(prompt_token_ids))
        arrival_time = arrival_time if arrival_time is not None else time.time()
        requests = []
        for i in range(params.n):
            child = params.child_params(i)
            requests.append(Request(child_request_id(request_id, i, params.n), prompt_token_ids, child,
                                    self.model_config.eos_token_ids, max_tokens, arrival_time, cache_salt,
                                    encoder_input=encoder_input, mm_features=mm_features, lora=lora))
        return requests

    # ---- pooling (embedding) requests ---------------------------------------------------------------------
    def tokenize_for_pooling(self, prompt: PromptType, params: PoolingParams,
                             add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Like ``tokenize``, then ``truncate_prompt_tokens``: text is cut by the tokenizer (its truncation
        side, special tokens kept), token ids keep their last k (as vLLM)."""
        limit = params.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and limit > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {limit} is more than the model's maximum length "
                             f"({self.max_model_len} tokens)")
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        if limit is not None and isinstance(text, str) and text:
            return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True,
                                               max_length=limit)
        text, token_ids = self.tokenize(prompt, add_special_tokens)
        return text, token_ids[-limit:] if limit is not None else token_ids

    def make_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                             arrival_time: float | None = None) -> Request:
        """One engine request that computes the prompt and finishes with its pooled vector."""
        if params.dimensions is not None:
            pooler = self.model_config.pooler_config
            hidden = int(getattr(self.model_config.hf_config, "hidden_size", 0) or 0)
            if not (pooler and pooler.enable_matryoshka):
                raise ValueError(f"dimensions: model {self.model_config.name!r} does not support Matryoshka "
                                 "representations, so its embeddings cannot be shortened")
            if hidden and params.dimensions > hidden:
                raise ValueError(f"dimensions: {params.dimensions} is more than the model's {hidden} dimensions")
        self.check_fits(len(prompt_token_ids), pooling=True)
        if self.model_config.is_encoder_decoder:
            raise ValueError(f"model: {self.model_config.name!r} is an encoder-decoder model; it cannot pool")
        return Request(request_id, prompt_token_ids, _POOLING_SAMPLING, [], 1,
                       arrival_time if arrival_time is not None else time.time(), pooling_params=params)


# Pooling requests sample nothing; the scheduler and runner still read a few SamplingParams fields.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)
