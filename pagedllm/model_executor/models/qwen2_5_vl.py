"""Qwen2.5-VL: Qwen2-VL (``qwen2_vl.py``) with a different ViT: RMSNorm, a gated SiLU MLP with biases, and window
attention. Most layers attend within windows of ``window_size`` px (whole merge blocks, the last window of a row or
column cut short by the picture's edge); the layers in ``fullatt_block_indexes`` attend each frame whole. The
patches are reordered so each window's are consecutive rows (the merger's blocks stay whole), and the merged
tokens are put back in the processor's order. The decoder and its M-RoPE positions are Qwen2-VL's (for images).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.attention.spec import AttentionSpec
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.models.blocks import GatedMLP, RotaryAttention
from pagedllm.model_executor.models.clip_vision import VISION_LAYER_IDX_BASE
from pagedllm.model_executor.models.qwen2_vl import Qwen2VisionTower, Qwen2VLForConditionalGeneration


class Qwen25VisionLayer(DirectCall, nn.Module):
    """norm1 -> attention (2D rotary) -> + -> norm2 -> gated MLP -> +, with ``VisionEncoderLayer``'s calling
    convention (the residual add run with the next norm)."""

    def __init__(self, cfg: Any, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = int(cfg.hidden_size), int(cfg.num_heads)
        prefix = f"visual.layers.{i}"
        self.layer_norm1 = RMSNorm(d, 1e-6, dtype)
        self.self_attn = RotaryAttention(d, heads, heads, d // heads, layer_idx=VISION_LAYER_IDX_BASE + i,
                                         dtype=dtype, spec=AttentionSpec.encoder(), qkv_bias=True, o_bias=True,
                                         prefix=f"{prefix}.self_attn")
        self.layer_norm2 = RMSNorm(d, 1e-6, dtype)
        self.mlp = GatedMLP(d, int(cfg.intermediate_size), cfg.hidden_act, bias=True, dtype=dtype,
                            prefix=f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``VisionEncoderLayer.forward``: (stream, this layer's MLP output still to add)."""
        if pending is None:
            h = self.layer_norm1(x)
        else:
            h, x = self.layer_norm1(pending, x)
        h, x = self.layer_norm2(self.self_attn(h, rope), x)
        return x, self.mlp(h)


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Merge blocks regrouped by window: (each block's index in the processor's order, in window order; each
    window's block count, empty windows left out). ``window``: merge blocks per window side."""
    order, lens, base = [], [], 0
    for t, h, w in grids:
        bh, bw = h // merge, w // merge
        blocks = np.arange(t * bh * bw).reshape(t, bh, bw)
        nh, nw = -(-bh // window), -(-bw // window)
        for frame in range(t):
            for r in range(nh):
                for c in range(nw):
                    cell = blocks[frame, r * window:(r + 1) * window, c * window:(c + 1) * window].reshape(-1)
                    if cell.size:
                        order.append(cell + base)
                        lens.append(int(cell.size))
        base += t * bh * bw
    return np.concatenate(order), lens


class Qwen25VisionTower(Qwen2VisionTower):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self._build(cfg, dtype, int(cfg.hidden_size), int(cfg.num_heads), int(cfg.out_hidden_size), RMSNorm)
        self.layers = nn.ModuleList(Qwen25VisionLayer(cfg, i, dtype) for i in range(cfg.depth))
        self.full_attention = {int(i) for i in cfg.fullatt_block_indexes}
        self.window = int(cfg.window_size) // self.merge // int(cfg.patch_size)  # merge blocks per window side

    def attention_plan(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor | None, list[list[int]]]:
        unit = self.merge ** 2
        blocks, block_lens = window_order(grids, self.merge, self.window)
        order = torch.from_numpy((blocks[:, None] * unit + np.arange(unit)).reshape(-1))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        windows = [n * unit for n in block_lens]
        return order, [frames if i in self.full_attention else windows for i in range(len(self.layers))]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's model with Qwen2.5-VL's vision tower."""

    vision_tower_class = Qwen25VisionTower
