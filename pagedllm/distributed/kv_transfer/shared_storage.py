"""``SharedStorageConnector``: whole KV blocks saved to and loaded from a directory (vLLM's example connector).

A producer saves every full prompt block it computes, once, as one file named by the block's storage key; a
consumer that finds the next blocks of a prompt past its local prefix-cache hit loads them at the start of the
step that computes the rest (synchronously). A file holds one block of every layer in the cache's own layout,
[num_layers, 2, block_size, Hkv, D], so a save or load is one copy per layer, never per token.

Storage keys are the prefix cache's chained sha256 hashes (``core/block_hash.py``) from a fixed root
(``kv_connector_extra_config.hash_seed``, default 0) and the request's cache salt: the same in every process, and
independent of ``--prefix-caching-hash-seed``. Extra config: ``shared_storage_path`` (default
``/tmp/pagedllm-kv-storage``), ``hash_seed``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.block_hash import compute_block_hash_values, root_hash_value
from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from pagedllm.logger import init_logger

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig

logger = init_logger(__name__)

DEFAULT_PATH = "/tmp/pagedllm-kv-storage"


class KVLoadError(RuntimeError):
    """A stored block could not be loaded (missing, truncated, another model's layout); its file is removed."""


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    loads: list[tuple[int, int]] = field(default_factory=list)  # (block id, storage key)
    saves: list[tuple[int, int]] = field(default_factory=list)


class SharedStorageConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int) -> None:
        super().__init__(config, role, block_size)
        self.path = str(config.get_from_extra_config("shared_storage_path", DEFAULT_PATH))
        self.root = root_hash_value(int(config.get_from_extra_config("hash_seed", 0)), "sha256")
        os.makedirs(self.path, exist_ok=True)
        # Scheduler half, per request: storage keys of its prompt's full blocks, its block table, blocks handled.
        self._keys: dict[str, list[int]] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_saved: dict[str, int] = {}
        self._loads: list[tuple[int, int]] = []
        # Worker half.
        self.kv_caches: list[Any] = []
        self.num_blocks_loaded = 0
        self.num_blocks_saved = 0

    def file_of(self, key: int) -> str:
        return os.path.join(self.path, f"{key:016x}.pt")

    # ---- scheduler half ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        # The request's own block keys (its LoRA adapter's digest) too: another adapter's KV is never loaded.
        keys = compute_block_hash_values(request.prompt_token_ids, self.block_size, self.root, "sha256",
                                         request.cache_salt, getattr(request, "block_keys", None))
        self._keys[request.request_id] = keys
        self._num_saved[request.request_id] = 0
        if not self.config.is_kv_consumer:
            return 0, False
        first = num_computed_tokens // self.block_size
        last = (request.num_prompt_tokens - 1) // self.block_size  # the last prompt token is always computed
        n = first
        while n < min(last, len(keys)) and os.path.exists(self.file_of(keys[n])):
            n += 1
        return (n - first) * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        keys = self._keys[request.request_id]
        first = request.num_local_hit_tokens // self.block_size
        for i in range(first, first + num_external_tokens // self.block_size):
            self._loads.append((block_ids[i], keys[i]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._loads)
        self._loads = []
        for rid in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._tables.pop(rid, None)
            if rid in scheduler_output.finished_req_ids:
                self._keys.pop(rid, None)
                self._num_saved.pop(rid, None)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.req_id in self._tables:
                self._tables[cached.req_id].extend(cached.new_block_ids[0])
            computed[cached.req_id] = cached.num_computed_tokens
        if not self.config.is_kv_producer:
            return meta
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            keys, table = self._keys.get(rid), self._tables.get(rid)
            if keys is None or table is None:
                continue
            full = min((computed[rid] + num) // self.block_size, len(keys))
            for i in range(self._num_saved[rid], full):
                if not os.path.exists(self.file_of(keys[i])):
                    meta.saves.append((table[i], keys[i]))
            self._num_saved[rid] = max(self._num_saved[rid], full)
        return meta

    # ---- worker half ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self.kv_caches = list(kv_caches)

    def _block_shape(self) -> tuple[int, ...]:
        c = self.kv_caches[0]
        return (len(self.kv_caches), 2, *c.shape[2:])

    def start_load_kv(self, forward_context: Any = None) -> None:
        import torch

        meta = self._metadata
        if not isinstance(meta, SharedStorageMetadata):
            return
        for block_id, key in meta.loads:
            path = self.file_of(key)
            try:
                data = torch.load(path, weights_only=True, map_location="cpu")
                if tuple(data.shape) != self._block_shape() or data.dtype != self.kv_caches[0].dtype:
                    raise ValueError(f"layout {tuple(data.shape)} {data.dtype} is not this cache's "
                                     f"{self._block_shape()} {self.kv_caches[0].dtype}")
            except Exception as e:  # noqa: BLE001 - the step fails, the requests recompute without this file
                _remove(path)
                raise KVLoadError(f"stored KV block {path} could not be loaded ({e}); it was removed") from e
            for layer, cache in enumerate(self.kv_caches):
                cache[:, block_id].copy_(data[layer], non_blocking=True)
            self.num_blocks_loaded += 1

    def wait_for_save(self) -> None:
        import torch

        meta = self._metadata
        if not isinstance(meta, SharedStorageMetadata):
            return
        for block_id, key in meta.saves:
            data = torch.stack([cache[:, block_id] for cache in self.kv_caches]).cpu()
            path = self.file_of(key)
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save(data, tmp)
            os.replace(tmp, path)  # readers see a whole file or none
            self.num_blocks_saved += 1


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
