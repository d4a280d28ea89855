"""``MultiConnector``: several connectors chained (vLLM's), e.g. NIXL for transfers and a directory as a second tier.

Every call goes to each connector, in the configured order, with its own metadata. Matched tokens come from the
first connector that offers any for a request (the others are told of no external tokens for it); a finished
request's blocks are held if any connector holds them, and the first ``kv_transfer_params`` returned wins. The
worker halves' reports are merged. Only the transfer connectors hold blocks (the shared-storage tier saves during
the step and never holds), so a held request is reported done by the one connector that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pagedllm.distributed.kv_transfer.config import sub_config

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    metadata: list[KVConnectorMetadata] = field(default_factory=list)


class MultiConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int) -> None:
        from pagedllm.distributed.kv_transfer.factory import create_connector

        super().__init__(config, role, block_size)
        subs = config.kv_connector_extra_config["connectors"]
        self.connectors = [create_connector(sub_config(config, raw), role, block_size) for raw in subs]
        self.layerwise = any(c.layerwise for c in self.connectors)
        self._chosen: dict[str, int] = {}  # request id -> the connector providing its tokens

    # ---- worker half ---------------------------------------------------------------------------------
    def set_kv_format(self, kv_format: str) -> None:
        super().set_kv_format(kv_format)
        for c in self.connectors:
            c.set_kv_format(kv_format)

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        metas = metadata.metadata if isinstance(metadata, MultiKVConnectorMetadata) else [None] * len(self.connectors)
        for c, m in zip(self.connectors, metas):
            c.bind_connector_metadata(m)

    def clear_connector_metadata(self) -> None:
        for c in self.connectors:
            c.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any = None) -> None:
        for c in self.connectors:
            c.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for c in self.connectors:
            out.merge(c.get_finished(finished_req_ids))
        return out

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()

    # ---- scheduler half ------------------------------------------------------------------------------
    def bind_worker(self, worker: KVConnectorBase_V1) -> None:
        assert isinstance(worker, MultiConnector)
        for c, w in zip(self.connectors, worker.connectors):
            c.bind_worker(w)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        found: tuple[int, bool] = (0, False)
        self._chosen.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):  # every one is asked: a tier may note the request for saving
            num, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if num and not found[0]:
                found = (num, load_async)
                self._chosen[request.request_id] = i
        return found

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        chosen = self._chosen.get(request.request_id)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        return MultiKVConnectorMetadata([c.build_connector_meta(scheduler_output) for c in self.connectors])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._chosen.pop(request.request_id, None)
        hold, params = False, None
        for c in self.connectors:
            h, p = c.request_finished(request, block_ids)
            hold = hold or h
            params = params if params is not None else p
        return hold, params
