"""Multi-LoRA serving: PEFT adapters beside every linear layer, batched per step (docs/lora.md)."""

from pagedllm.lora.request import AdapterRef, LoRARequest

__all__ = ["AdapterRef", "LoRARequest"]
