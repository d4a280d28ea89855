"""Idefics3 / SmolVLM: a SigLIP-style vision tower over image tiles, pixel shuffle, one projection, and a Llama-shaped
decoder (SmolLM2 in SmolVLM).

    image -> the processor's tiles (a grid of crops + the whole picture, each max_image_size square)
          -> vision tower per tile (patch conv, learned positions, [ LN -> attention -> + -> LN -> MLP -> + ] x L,
             post-LN) -> pixel shuffle (s x s neighbouring patches into one vector) -> linear -> image_seq_len
             embeddings per tile
    prompt: per tile <fake_token_around_image> <row_r_col_c> <image> x image_seq_len ..., the whole picture last
            (<global-img>); the <image> rows take the tiles' embeddings in order, the tags stay text

The processor does the splitting, resizing and tags; an image's feature spans its first to its last <image> token
with an embed mask over the tags (``core/multimodal.py``). Tiles the processor padded a batch with (all zeros) are
dropped, as transformers drops them. Tiles are whole squares when the processor splits images (SmolVLM's default);
a partly padded tile (splitting off) is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.models.blocks import make_linear
from pagedllm.model_executor.models.image_text import ImageTextLM
from pagedllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel
from pagedllm.model_executor.models.siglip_vision import SiglipVisionTower
from pagedllm.model_executor.models.weight_loading import STACKED_QKV_GATE_UP, WeightMapping

_PREFIXES = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
             ("model.connector.", "connector."), ("vision_model.encoder.layers.", "vision_model.layers."),
             ("vision_model.embeddings.", "vision_model."))


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = make_linear(vision_hidden * scale_factor ** 2, text_hidden, bias=False,
                                                    dtype=dtype, prefix="connector.modality_projection.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, patches, d] -> [n, patches / s^2, text hidden]: each s x s block of neighbouring patches becomes
        one vector (transformers' pixel shuffle order), then projected."""
        n, seq, d = x.shape
        s, side = self.scale_factor, int(seq ** 0.5)
        x = x.view(n, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3).reshape(n, seq // (s * s), d * s * s)
        return self.modality_projection.proj(x.reshape(-1, d * s * s)).view(n, seq // (s * s), -1)


class Idefics3ForConditionalGeneration(ImageTextLM):
    """``forward(input_ids, positions, inputs_embeds=None)`` is the decoder step; ``embed_images`` the vision part."""

    supports_multimodal = True
    checkpoint_prefixes = _PREFIXES
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, renames=(("self_attn.out_proj.", "self_attn.o_proj."),),
                                   skip=("rotary_emb.inv_freq",))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        text, vision = hf_config.text_config, hf_config.vision_config
        if text.model_type not in ("llama",):
            raise ValueError(f"Idefics3: text model type {text.model_type!r} is not supported (llama)")
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_model = SiglipVisionTower(vision, dtype, "vision_model")
        self.connector = Idefics3Connector(vision.hidden_size, text.hidden_size, int(hf_config.scale_factor), dtype)
        self.model = LlamaModel(text, LlamaForCausalLM, dtype, quant_config)
        # transformers ties the head by the top-level flag, not the text model's.
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._init_head(text, dtype, quant_config)

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each image's processor output ({"pixel_values": [1, tiles, C, S, S], "pixel_attention_mask": [1, tiles,
        S, S]}) -> its embeddings [real tiles * image_seq_len, text hidden], tiles in the prompt's order."""
        device = self.embedding().weight.device
        tiles, counts = [], []
        for image in images:
            pixels = torch.as_tensor(np.asarray(image["pixel_values"]))[0]  # [tiles, C, S, S]
            real = pixels.flatten(1).ne(0).any(dim=1)  # all-zero tiles pad a batch of images
            mask = image.get("pixel_attention_mask")
            if mask is not None and not bool(torch.as_tensor(np.asarray(mask))[0][real].all()):
                raise ValueError("image: a partly padded tile is not supported (keep the processor's image splitting)")
            tiles.append(pixels[real])
            counts.append(int(real.sum()))
        states = self.vision_model(torch.cat(tiles).to(device=device, dtype=self.dtype))
        embeds = self.connector(states)  # [tiles, image_seq_len, hidden]
        return [e.reshape(-1, e.shape[-1]) for e in embeds.split(counts)]
