"""The KV connector interface (vLLM's ``KVConnectorBase_V1``): how KV blocks enter and leave an instance.

One connector class, two instances per engine: the **scheduler half** (``role=SCHEDULER``, no torch needed)
decides which prompt tokens come from elsewhere and which blocks must be held for a reader; the **worker half**
(``role=WORKER``) moves the blocks between the KV cache tensors and the transport. The scheduler hands the
worker one ``KVConnectorMetadata`` per step (``build_connector_meta``, carried on the ``SchedulerOutput``); the
worker answers with a ``KVConnectorOutput`` on the ``ModelRunnerOutput`` (``get_finished``).

Scheduler half, per request:
- ``get_num_new_matched_tokens(request, num_computed_tokens)`` → ``(n, load_async)``: how many prompt tokens past
  the local prefix-cache hit the connector can provide. ``load_async=False``: they are loaded at the start of the
  step that computes the rest; ``True``: the request waits in ``WAITING_FOR_REMOTE_KVS`` (others keep running)
  until the worker reports it in ``finished_recving`` (or ``failed_recving``: the prompt is then recomputed).
- ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the blocks allocated for them.
- ``build_connector_meta(scheduler_output)``: this step's work for the worker half.
- ``request_finished(request, block_ids)`` → ``(hold, kv_transfer_params)``: ``hold=True`` keeps the request's
  blocks allocated until the worker reports it in ``finished_sending`` (a producer's blocks awaiting their reader,
  or a consumer's blocks still being written); the params go back to the client.

Worker half, per step: ``register_kv_caches`` once; then ``bind_connector_metadata``, ``start_load_kv`` (before
the forward), ``wait_for_layer_load`` / ``save_kv_layer`` (per layer, for connectors with ``layerwise``),
``wait_for_save`` (after the forward), ``get_finished(finished_req_ids)``, ``clear_connector_metadata``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """One step's instructions from a connector's scheduler half to its worker half (each connector subclasses)."""


@dataclass
class KVConnectorOutput:
    """What the worker half reports after a step: request ids whose blocks may now be freed (``finished_sending``:
    read by the remote side, or timed out; also a consumer's aborted requests once no write is in flight), whose
    blocks arrived (``finished_recving``) or could not be received (``failed_recving``: recompute the prompt)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def merge(self, other: KVConnectorOutput) -> None:
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.failed_recving |= other.failed_recving

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnectorBase_V1:  # noqa: N801 (vLLM's name)
    """Base of every connector; the defaults do nothing (a connector overrides the calls it needs)."""

    # True: the runner calls wait_for_layer_load / save_kv_layer around each layer (none of ours needs it:
    # whole blocks move before and after the forward).
    layerwise = False
    # The cache's dtype and, for fp8, every layer's k/v scales (set_kv_format): a block read with other scales
    # than it was stored with would be wrong, so the transfer connectors refuse a peer whose format differs.
    kv_format = ""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int) -> None:
        self.config = config
        self.role = role
        self.block_size = block_size
        self._metadata: KVConnectorMetadata | None = None

    # ---- worker half ---------------------------------------------------------------------------------
    def set_kv_format(self, kv_format: str) -> None:
        """Before register_kv_caches: what the cache's bytes mean (``kv_format``)."""
        self.kv_format = kv_format

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The engine's KV cache, one tensor per cached layer [2, num_blocks, block_size, Hkv, D]."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start (or, for a synchronous connector, do) this step's loads into the KV cache, before the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s part of this step's loads is in place (layerwise connectors)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Start saving one layer's blocks after it wrote its K/V (layerwise connectors)."""

    def wait_for_save(self) -> None:
        """Finish this step's saves, after the forward (the step's K/V is in the cache)."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Requests whose sends / receives completed since the last call; ``finished_req_ids``: requests the
        scheduler finished or aborted since the last step (a receive for one of them is cancelled)."""
        return KVConnectorOutput()

    def shutdown(self) -> None:
        """Release sockets, threads and registrations."""

    # ---- scheduler half ------------------------------------------------------------------------------
    def bind_worker(self, worker: KVConnectorBase_V1) -> None:
        """The same engine's worker half (set once at start-up, after its KV caches were registered)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """``block_ids``: the request's whole block table (group 0) after the allocation."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def kv_transfer_params(request: Request) -> dict[str, Any] | None:
    """The client's ``kv_transfer_params`` of a request (vLLM keeps them in ``SamplingParams.extra_args``)."""
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    params = extra.get("kv_transfer_params")
    return params if isinstance(params, dict) else None
