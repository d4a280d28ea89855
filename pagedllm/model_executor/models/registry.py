"""HF ``architectures`` name -> our model class."""

from __future__ import annotations

from pagedllm.model_executor.models.bert import BertModel
from pagedllm.model_executor.models.llama import LlamaForCausalLM

_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # same layers; sliding window is capped by the loader
    "BertModel": BertModel,  # encoder-only: pooling runner (embeddings)
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_cls(architectures: list[str]) -> type:
    """First supported class among ``architectures`` (as in a config.json); ValueError if none."""
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"model architecture {list(architectures or [])} is not supported; "
                     f"supported architectures: {', '.join(supported_architectures())}")
