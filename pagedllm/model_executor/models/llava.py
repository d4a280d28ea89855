"""LLaVA-style vision-language models: a CLIP vision tower, a two-layer projector, and a Llama-shaped decoder.

    image -> vision tower (hidden states of ``vision_feature_layer``; CLS dropped under the "default" strategy)
          -> projector (linear -> act -> linear) -> one embedding per image token
    prompt ids -> token embeddings, with the rows of the image's placeholder tokens replaced by those embeddings
          -> the decoder (``llama.LlamaModel``) -> head

The engine calls ``embed_images`` once per image (batched over a step's new images; the runner keeps the
outputs in its encoder cache, ``worker/multimodal_runner.py``) and ``forward(..., inputs_embeds=...)`` in steps
that compute image tokens; a text-only step is the plain decoder step. Checkpoint names are read in both the
layout transformers saves (``language_model.model.*``, ``vision_tower.*``) and the one it holds in memory
(``model.language_model.*``, ``model.vision_tower.*``), and the original ``vision_tower.vision_model.*``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.models.blocks import make_linear
from pagedllm.model_executor.models.clip_vision import CLIPVisionTower, layers_for_feature_layer, vision_activation
from pagedllm.model_executor.models.image_text import ImageTextLM
from pagedllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel, Qwen2ForCausalLM
from pagedllm.model_executor.models.weight_loading import STACKED_QKV_GATE_UP, WeightMapping

# The decoder classes a LLaVA's text_config may name (by model_type).
_TEXT_ARCHS: dict[str, type[LlamaForCausalLM]] = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
                                                  "qwen2": Qwen2ForCausalLM}
# Checkpoint prefixes -> ours, applied in order (a name may match several: model.vision_tower.vision_model.*).
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."),
             ("vision_tower.vision_model.", "vision_tower."), ("vision_tower.encoder.layers.", "vision_tower.layers."))
_VISION_LAYER = re.compile(r"^vision_tower\.layers\.(\d+)\.")


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = make_linear(vision_hidden, text_hidden, bias=bias, dtype=dtype,
                                    prefix="multi_modal_projector.linear_1")
        self.linear_2 = make_linear(text_hidden, text_hidden, bias=bias, dtype=dtype,
                                    prefix="multi_modal_projector.linear_2")
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, vision hidden] -> [T, text hidden]."""
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(ImageTextLM):
    """``forward(input_ids, positions, inputs_embeds=None)`` is the decoder step; ``embed_images`` the vision part."""

    supports_multimodal = True
    checkpoint_prefixes = _PREFIXES
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, renames=(("self_attn.out_proj.", "self_attn.o_proj."),),
                                   skip=("rotary_emb.inv_freq", "vision_tower.post_layernorm."))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        text, vision = hf_config.text_config, hf_config.vision_config
        arch = _TEXT_ARCHS.get(text.model_type)
        if arch is None:
            raise ValueError(f"LLaVA: text model type {text.model_type!r} is not supported ({sorted(_TEXT_ARCHS)})")
        if vision.model_type not in ("clip_vision_model",):
            raise ValueError(f"LLaVA: vision tower {vision.model_type!r} is not supported (clip_vision_model)")
        feature_layer = hf_config.vision_feature_layer
        if not isinstance(feature_layer, int):
            raise ValueError("LLaVA: a list of vision_feature_layer values is not supported")
        self.select_strategy = hf_config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"LLaVA: vision_feature_select_strategy {self.select_strategy!r} is not supported")
        self.image_token_id = int(hf_config.image_token_id)
        num_layers = layers_for_feature_layer(feature_layer, vision.num_hidden_layers)
        self.num_vision_layers = num_layers
        self.vision_tower = CLIPVisionTower(vision, num_layers, dtype)
        self.multi_modal_projector = LlavaProjector(vision.hidden_size, text.hidden_size,
                                                    hf_config.projector_hidden_act,
                                                    bool(getattr(hf_config, "multimodal_projector_bias", True)), dtype)
        # The decoder quantizes like any text model; the vision tower and projector stay in the model dtype.
        self.model = LlamaModel(text, arch, dtype, quant_config)
        # transformers ties the head by the top-level flag (LLaVA's follows its text model's).
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings))
        self._init_head(text, dtype, quant_config)

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each image's processor output ({"pixel_values": [1, C, H, W]}) -> its embeddings [tokens, text hidden]."""
        device = self.embedding().weight.device
        pixels = torch.cat([torch.as_tensor(np.asarray(image["pixel_values"])) for image in images])
        states = self.vision_tower(pixels.to(device=device, dtype=self.dtype))  # [n, 1 + patches, d]
        if self.select_strategy == "default":
            states = states[:, 1:]  # the CLS token is not an image token
        n, tokens, d = states.shape
        embeds = self.multi_modal_projector(states.reshape(n * tokens, d))
        return list(embeds.view(n, tokens, -1).unbind(0))

    def our_name(self, name: str) -> str | None:
        """Vision layers past the feature layer (never run) are not loaded."""
        name = super().our_name(name)
        match = _VISION_LAYER.match(name)
        return None if match and int(match.group(1)) >= self.num_vision_layers else name
