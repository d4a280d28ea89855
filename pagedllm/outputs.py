"""Results handed to users, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Times in seconds since the epoch (``time.time()``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    # Where a KV connector left this request's KV (a prefill instance's answer for the decode instance).
    kv_transfer_params: dict | None = None


@dataclass
class PoolingOutput:
    """A pooling model's output for one request: ``data`` is a float32 CPU tensor [hidden] (or [dimensions])."""

    data: Any


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """Shaped like vLLM's: ``outputs`` is None only for an aborted or failed request (see finish_reason)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    finish_reason: str | None = None  # "stop" when pooled; "abort" | "error"
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt: ``outputs.embedding`` is a list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        if out.outputs is None:
            raise RuntimeError(f"request {out.request_id} produced no embedding ({out.finish_reason})")
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.finished, out.prompt)
