"""Pydantic request/response models of the OpenAI API (plus vLLM's extra sampling fields)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.entrypoints.openai.structured import reject_unsupported_fields, structured_outputs_from_request
from pagedllm.sampling_params import SamplingParams


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do (clients send newer fields).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class _SamplingFields(OpenAIModel):
    """Fields shared by completions and chat; turned into ``SamplingParams``."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (see structured.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Disaggregated prefill / decode (vLLM's): do_remote_decode to a prefill instance, the prefill instance's
    # answer (do_remote_prefill, remote_block_ids, remote_engine_id, remote_host, remote_port) to a decode one.
    kv_transfer_params: dict[str, Any] | None = None

    # Fields that change what the output must be are never silently dropped (extra="ignore" above).
    _check_unsupported = model_validator(mode="before")(reject_unsupported_fields)

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            structured_outputs=structured_outputs_from_request(self.response_format, self.structured_outputs),
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            extra_args=self._kv_transfer_extra_args())

    def _kv_transfer_extra_args(self) -> dict[str, Any] | None:
        if self.kv_transfer_params is None:
            return None
        if self.n != 1:
            raise ValueError("kv_transfer_params: only requests with n = 1 can move their KV cache")
        return {"kv_transfer_params": dict(self.kv_transfer_params)}


# ---- completions ------------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        params = self._params(max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            # Echoed prompt tokens carry logprobs too.
            params.prompt_logprobs = self.logprobs
        return params


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer (where its KV blocks are)


# ---- chat ---------------------------------------------------------------------------------------------
class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # Tool calling (entrypoints/openai/tools.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (--reasoning-parser): end the thinking after this many tokens (vLLM's name)
    thinking_token_budget: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)


class ChatLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # The thinking of a reasoning model (--reasoning-parser); reasoning_content is the older name of the same.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer (where its KV blocks are)


# ---- models, tokenizer ----------------------------------------------------------------------------------
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    architecture: str | None = None  # the served model's HF architecture name


class LoadLoRAAdapterRequest(OpenAIModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    supported_architectures: list[str] | None = None  # what this server build can load
    architecture_formats: dict[str, list[str]] | None = None  # architecture -> "hf" and/or "gguf"


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


# ---- embeddings, pooling, score (pooling models) ----------------------------------------------------------
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class _PoolingFields(OpenAIModel):
    model: str | None = None
    user: str | None = None
    # vLLM extras
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None


class EmbeddingRequest(_PoolingFields):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format=base64


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingRequest(EmbeddingRequest):
    pass


class PoolingData(OpenAIModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ScoreRequest(_PoolingFields):
    """vLLM's /score for embedding models: cosine similarity of text_1 against text_2 (1:1, 1:N or N:N)."""

    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo
