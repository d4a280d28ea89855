"""The front end's side of adapters: a ``LoRARequest`` checked against the base model, as an ``AdapterRef``.

Checking here (reading the folder, every rule of ``peft_checkpoint``) means a bad adapter fails the request that
names it with a ValueError, before anything is queued; the worker reads the same files again by their digest.
Checked adapters are remembered by the files' size and modification time, so a folder rewritten in place is
read, digested and checked again.
"""

from __future__ import annotations

import os
from typing import Any

from pagedllm.lora.peft_checkpoint import adapter_digest, adapter_files, load_peft_adapter
from pagedllm.lora.request import AdapterRef, LoRARequest
from pagedllm.lora.target_modules import base_module_shapes


class AdapterResolver:
    def __init__(self, hf_config: Any, max_lora_rank: int) -> None:
        self.base_shapes = base_module_shapes(hf_config)
        self.max_lora_rank = max_lora_rank
        self._checked: dict[tuple, str] = {}  # (path, files' size and mtime) -> digest of a checked adapter

    def resolve(self, lora: LoRARequest | AdapterRef) -> AdapterRef:
        """The adapter's ``AdapterRef`` (its content digest), after checking that it applies to the base model;
        ValueError saying why not."""
        if isinstance(lora, AdapterRef):
            return lora
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora).__name__}")
        path = os.path.abspath(os.path.expanduser(lora.lora_path))
        key = (path, *(_file_identity(f) for f in adapter_files(path)))
        digest = self._checked.get(key)
        if digest is None:
            digest = adapter_digest(path)
            load_peft_adapter(path, self.base_shapes, self.max_lora_rank, digest)
            self._checked[key] = digest
        return AdapterRef(lora.lora_name, lora.lora_int_id, path, digest)


def _file_identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
