"""What names an adapter: the user's ``LoRARequest`` (vLLM's) and the ``AdapterRef`` that rides a request.

``AdapterRef`` is plain data (msgspec): it crosses the engine-core messages as it is, the scheduler counts adapters
by its ``digest``, the prefix cache keys blocks by it, and the worker loads the adapter from its ``path``. The
digest covers the adapter's content (``peft_checkpoint.adapter_digest``), never its name: two adapters under one
name, or one name reloaded with other weights, never share a key.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to apply to a request, as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_int_id`` must be positive (0 means "no adapter" in vLLM); ``lora_path`` is a PEFT folder
    (``adapter_config.json`` + ``adapter_model.safetensors``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name: must not be empty")


class AdapterRef(msgspec.Struct, array_like=True, frozen=True):
    """One loaded-and-checked adapter as the engine sees it: ``digest`` identifies its content."""

    name: str
    int_id: int
    path: str
    digest: str
