"""A request as the scheduler sees it: token ids, progress and status. No torch here."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from pagedllm.core.block_hash import BlockKeysFn
from pagedllm.core.multimodal import MultiModalFeature, multimodal_block_keys

if TYPE_CHECKING:
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Queued, but its structured-output grammar is still compiling: the scheduler skips it until the engine
    # sets it back to WAITING.
    WAITING_FOR_GRAMMAR = enum.auto()
    # Queued with its blocks allocated while a KV connector receives its prompt's KV from another instance
    # (core/remote_kv.py): the scheduler skips it until the transfer ends.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the model step failed on this request

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated. ``num_computed_tokens`` catches up with ``num_tokens`` each step."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: list[int], max_tokens: int, arrival_time: float | None = None,
                 cache_salt: str | None = None, pooling_params: PoolingParams | None = None,
                 encoder_input: Any = None, mm_features: list[MultiModalFeature] | None = None,
                 lora: Any = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt
        # Pooling requests sample nothing: they finish once their prompt has been computed.
        self.pooling_params = pooling_params
        # An encoder-decoder request's encoder input (Whisper: float32 log-mel [n_mels, 3000]); opaque here.
        self.encoder_input = encoder_input
        # The prompt's images, in prompt order (core/multimodal.py); empty for a text prompt.
        self.mm_features: list[MultiModalFeature] = list(mm_features or [])
        # The LoRA adapter it runs with (``lora.request.AdapterRef``: name, id, path, content digest), or None.
        self.lora = lora
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_failed_steps = 0  # model steps that raised while this request was in the batch
        self.block_hashes: list[Any] = []  # chained hashes of its full blocks, filled by the KV manager
        self.first_scheduled_time: float | None = None
        self.spec_token_ids: list[int] = []  # drafts to verify in its next step (speculative decoding)
        # KV connector (core/remote_kv.py): prompt tokens whose KV came from a connector / the local prefix cache
        # at admission, and whether a transfer failed (the prompt is then recomputed, never asked for again).
        self.num_external_computed_tokens = 0
        self.num_local_hit_tokens = 0
        self.kv_transfer_failed = False

    @property
    def lora_key(self) -> str | None:
        """Its adapter's content digest (what the scheduler counts adapters by), None for the base model."""
        return self.lora.digest if self.lora is not None else None

    @property
    def block_keys(self) -> BlockKeysFn | None:
        """The per-block extra keys of its prefix-cache hashes (``core/block_hash.py``), None when it has none:
        the adapter's content digest on the first block (so no other adapter, and no base-model request, ever
        shares its blocks; later blocks inherit it through the chain), and the images with tokens in a block."""
        if not self.mm_features and self.lora is None:
            return None
        adapter = ("lora:" + self.lora.digest,) if self.lora is not None else ()
        features = self.mm_features
        return lambda start, end: (adapter if start == 0 else ()) + (
            multimodal_block_keys(features, start, end) if features else ())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Apply token-level stop rules after a token was appended; sets status and stop_reason."""
        num_out = self.num_output_tokens
        last = self.output_token_ids[-1]
        if num_out >= self.sampling_params.min_tokens:
            if last in self.eos_token_ids and not self.sampling_params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_out >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
