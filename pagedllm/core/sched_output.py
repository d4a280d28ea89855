"""What the scheduler hands the model runner each step: diffs, not whole state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled (and again when it resumes after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only for a resumed request
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # the block table in each KV cache group
    num_computed_tokens: int
    pooling_params: Any = None  # PoolingParams for a pooling request
    # An encoder-decoder request's encoder input (audio_features): the runner runs its encoder this step.
    encoder_input: Any = None
    # The prompt's images (core/multimodal.py MultiModalFeature, with their processed pixels); empty for text.
    mm_features: list = field(default_factory=list)
    lora: Any = None  # its LoRA adapter (lora.request.AdapterRef), None for the base model


@dataclass
class CachedRequestData:
    """For a request the runner already knows: only its newly allocated blocks."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # finished/aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs (set by the engine after scheduling, never by the scheduler): the requests that
    # sample under a grammar this step, and their allowed-token bitmask [len(ids), ceil(V/32)] int32.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # req_id -> draft tokens to verify this step; they are the last len(...) of its scheduled tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The KV connector's instructions for its worker half this step (distributed/kv_transfer/), or None.
    kv_connector_metadata: Any = None
    # Content hashes of images whose encoder outputs the runner drops before this step (core/encoder_cache.py).
    free_encoder_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: the new tokens (absent for a partial prefill chunk) and logprobs.

    A request that verified drafts gets its accepted drafts plus one more token (1 to k+1 tokens);
    ``spec_token_ids`` are the drafts proposed for its next step.
    """

    sampled_token_ids: dict[str, list[int]]
    # req_id -> list (one per new token) of {token_id: (logprob, rank)}; first entry is the sampled token.
    logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)
    # req_id -> list (one per prompt position after the first) of the same mapping.
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)
    # req_id -> pooled vector (a float32 CPU tensor) for pooling requests whose prompt is now complete.
    pooler_output: dict[str, Any] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The draft governor's decisions since start-up (spec_decode/governor.py): "<batch bucket>:<on|off>" -> times.
    spec_governor_decisions: dict[str, int] = field(default_factory=dict)
    # The KV connector worker half's report (distributed/kv_transfer/base.KVConnectorOutput), or None.
    kv_connector_output: Any = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request, for the front end to detokenize and stream.

    A msgspec Struct: it crosses the engine-core process boundary as it is (``engine/core_messages.py``).
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, tuple[float, int]]] | None = None
    prompt_logprobs: list[dict[int, tuple[float, int]]] | None = None
    num_cached_tokens: int = 0
    # The pooled vector of a finished pooling request: a float32 tensor in the engine, its raw bytes on the wire.
    pooling_output: Any = None
    # A finished request's kv_transfer_params from the KV connector (a producer: where its blocks can be read).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
