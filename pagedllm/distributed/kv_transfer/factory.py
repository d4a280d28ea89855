"""Build a connector by its ``kv_connector`` name (each module imported only when it is used)."""

from __future__ import annotations

import importlib

from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from pagedllm.distributed.kv_transfer.config import KVTransferConfig

_CONNECTORS = {
    "SharedStorageConnector": ("pagedllm.distributed.kv_transfer.shared_storage", "SharedStorageConnector"),
    "NixlConnector": ("pagedllm.distributed.kv_transfer.nixl", "NixlConnector"),
    "MultiConnector": ("pagedllm.distributed.kv_transfer.multi", "MultiConnector"),
}


def create_connector(config: KVTransferConfig, role: KVConnectorRole, block_size: int) -> KVConnectorBase_V1:
    module_name, class_name = _CONNECTORS[config.kv_connector]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(config, role, block_size)


def create_connector_pair(config: KVTransferConfig, block_size: int) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
    """(scheduler half, worker half) of one engine. They live in the same process: once the worker half has the
    KV cache, the engine hands it to the scheduler half (``bind_worker``: e.g. the side channel's port)."""
    worker = create_connector(config, KVConnectorRole.WORKER, block_size)
    scheduler = create_connector(config, KVConnectorRole.SCHEDULER, block_size)
    return scheduler, worker
