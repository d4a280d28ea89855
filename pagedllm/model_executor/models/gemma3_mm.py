"""Gemma 3's multimodal checkpoints (gemma-3-4b/12b/27b): a SigLIP vision tower, an average-pooling projector, and
the Gemma 3 text decoder (``gemma3.Gemma3Model``).

    image (the processor's one square, 896 px in the released models) -> SigLIP tower -> [patches, d]
          -> average pool of k x k neighbouring patches -> Gemma RMSNorm -> x W (d -> text hidden)
          -> ``mm_tokens_per_image`` embeddings (256)
    prompt: ``<start_of_image>`` expanded by the processor into <start_of_image> <image_soft_token> x 256
            <end_of_image>; the soft tokens take the image's rows (unscaled: only text embeddings carry Gemma's
            sqrt(hidden) scale)

Each image's soft tokens attend to each other both ways, inside the otherwise causal (and sliding-window) text
layers, as transformers' ``token_type_ids`` mask has it: ``image_tokens_attend_bidirectionally`` makes the
scheduler compute each image's run in one step and the attention layers attend across it
(``attention/backends/bidirectional_runs.py``). Checkpoint names are read in the layout transformers saves
(``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``), the one it holds in memory
(``model.language_model.*`` ...) and the released one (``vision_tower.vision_model.*``). Pan-and-scan crops
(``do_pan_and_scan``) are not supported: such a prompt is refused with the processor's token count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm
from pagedllm.model_executor.models.gemma3 import Gemma3Model
from pagedllm.model_executor.models.image_text import ImageTextLM
from pagedllm.model_executor.models.siglip_vision import SiglipVisionTower
from pagedllm.model_executor.models.weight_loading import STACKED_QKV_GATE_UP, WeightMapping

# Checkpoint prefixes -> ours, applied in order (a name may match several).
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."),
             ("vision_tower.vision_model.", "vision_tower."), ("vision_tower.embeddings.", "vision_tower."),
             ("vision_tower.encoder.layers.", "vision_tower.layers."))


class Gemma3Projector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.text_config
        patches_per_side = int(vision.image_size) // int(vision.patch_size)
        tokens_per_side = int(round(int(hf_config.mm_tokens_per_image) ** 0.5))
        if tokens_per_side ** 2 != int(hf_config.mm_tokens_per_image) or patches_per_side % tokens_per_side:
            raise ValueError(f"Gemma 3: mm_tokens_per_image {hf_config.mm_tokens_per_image} does not pool a "
                             f"{patches_per_side} x {patches_per_side} patch grid evenly")
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text.hidden_size, dtype=dtype), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, patches, d] -> [n, mm_tokens_per_image, text hidden]."""
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [n, tokens, d]
        tokens = pooled.shape[1]
        normed = self.mm_soft_emb_norm(pooled.reshape(n * tokens, d).contiguous())
        return torch.matmul(normed, self.mm_input_projection_weight).view(n, tokens, -1)


class Gemma3ForConditionalGeneration(ImageTextLM):
    """``forward(input_ids, positions, inputs_embeds=None)`` is the decoder step; ``embed_images`` the vision part."""

    supports_multimodal = True
    image_tokens_attend_bidirectionally = True
    checkpoint_prefixes = _PREFIXES
    # SigLIP's pooling head is skipped: Gemma 3 reads the patches' last hidden states.
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, renames=(("self_attn.out_proj.", "self_attn.o_proj."),),
                                   skip=("rotary_emb.inv_freq", "vision_tower.head."))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        text, vision = hf_config.text_config, hf_config.vision_config
        if vision.model_type not in ("siglip_vision_model",):
            raise ValueError(f"Gemma 3: vision tower {vision.model_type!r} is not supported (siglip_vision_model)")
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_tower = SiglipVisionTower(vision, dtype, "vision_tower")
        self.multi_modal_projector = Gemma3Projector(hf_config, dtype)
        # The decoder quantizes like any text model; the vision tower and projector stay in the model dtype.
        self.model = Gemma3Model(text, dtype, quant_config)
        # Gemma 3 ties its head by the top-level flag (the released checkpoints ship no lm_head).
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        # An image token outside the vocabulary embeds as token 0 (its row is replaced), as transformers does.
        self._image_token_outside_vocab = self.image_token_id >= int(text.vocab_size)
        self._init_head(text, dtype, quant_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> scaled token embeddings [T, hidden] (a fresh tensor the caller writes image rows into)."""
        if self._image_token_outside_vocab:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return self.model.embed(input_ids)

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each image's processor output ({"pixel_values": [1, C, S, S]}) -> its embeddings [mm_tokens_per_image,
        text hidden]."""
        device = self.embedding().weight.device
        pixels = torch.cat([torch.as_tensor(np.asarray(image["pixel_values"])) for image in images])
        states = self.vision_tower(pixels.to(device=device, dtype=self.dtype))  # [n, patches, d]
        return list(self.multi_modal_projector(states).unbind(0))
