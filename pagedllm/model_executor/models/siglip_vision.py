"""The SigLIP vision transformer (Idefics3 / SmolVLM's and Gemma 3's vision tower) in pagedllm's layers.

    pixels [n, C, S, S] -> patch conv (with bias) + learned positions (no class token)
        -> [ LN -> self-attention (bidirectional, per image) -> + -> LN -> MLP -> + ] x L -> post-LN

The layers are CLIP's (``clip_vision.VisionEncoderLayer``); only the embeddings and the closing LayerNorm differ.
Every image (tile) is a whole ``image_size`` square, so the positions are the table's rows in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import LayerNorm
from pagedllm.model_executor.models.clip_vision import VisionEncoderLayer, run_vision_layers


class SiglipVisionTower(DirectCall, nn.Module):
    """``prefix``: where the checkpoint keeps the tower (names quantization and kernel choices)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.patch_size = int(cfg.patch_size)
        self.num_patches = (int(cfg.image_size) // self.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, self.patch_size, stride=self.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(self.num_patches, d, dtype=dtype)
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, i, dtype, f"{prefix}.encoder.layers")
                                    for i in range(cfg.num_hidden_layers))
        self.post_layernorm = LayerNorm(d, cfg.layer_norm_eps, dtype)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        """tiles: [n, C, S, S] (S = the config's image_size) -> [n, patches, d]."""
        x = self.patch_embedding(tiles).flatten(2).transpose(1, 2)
        n, seq, d = x.shape
        if seq != self.num_patches:
            raise ValueError(f"image: a {tuple(tiles.shape[2:])} tile gives {seq} patches; the vision tower takes "
                             f"{self.num_patches} (its image processor's size)")
        x = (x + self.position_embedding.weight).reshape(n * seq, d).contiguous()  # one tile: still transposed
        x = run_vision_layers(self, self.layers, x, [seq] * n)
        return self.post_layernorm(x).view(n, seq, d)
