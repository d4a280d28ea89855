"""Qwen2-VL: a ViT over dynamic-resolution images with 2D rotary positions, a patch merger, and a Qwen2 decoder with
multimodal rotary positions (M-RoPE, ``models/mrope.py``).

    image -> the processor (transformers' Qwen2VLImageProcessor: resized to multiples of patch * merge, cut into
             patches of 2 frames x p x p, grid (t, h, w) patches) -> patch projection (the Conv3d as one matmul)
          -> [ LN -> attention with 2D rotary (height, width of each patch) -> + -> LN -> MLP -> + ] x depth
          -> merger: LN, each merge x merge block of patches concatenated, Linear -> GELU -> Linear
          -> t * h * w / merge^2 embeddings
    prompt: <|vision_start|> <|image_pad|> x tokens <|vision_end|>; the pad rows take the embeddings

The processor orders each image's patches by merge block, so the merger's blocks are consecutive rows. The text
positions of a request come from its prompt (``prompt_positions``) and are kept by the model runner.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import LayerNorm
from pagedllm.model_executor.layers.rotary_embedding import apply_rotary
from pagedllm.model_executor.models.blocks import make_linear
from pagedllm.model_executor.models.clip_vision import VisionEncoderLayer, run_vision_layers
from pagedllm.model_executor.models.image_text import ImageTextLM
from pagedllm.model_executor.models.llama import Qwen2ForCausalLM
from pagedllm.model_executor.models.mrope import MRopeLlamaModel, prompt_positions
from pagedllm.model_executor.models.weight_loading import STACKED_QKV_GATE_UP, WeightMapping

_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
_VISION_RENAMES = ((".blocks.", ".layers."), (".norm1.", ".layer_norm1."), (".norm2.", ".layer_norm2."),
                   (".attn.qkv.", ".self_attn.qkv_proj."), (".attn.proj.", ".self_attn.o_proj."))


class VisionRope:
    """The vision tower's 2D rotary for one call: each patch's angles are its row's frequencies then its column's
    (head_dim / 4 each), rotate-half pairing over the whole head, computed in float32 as transformers does."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin  # [N, 1, D/2] float32

    def rotate_qk(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv: [N, 3 * H * D] -> rotated q [N, H*D], k [N, H*D] (new tensors in qkv's dtype)."""
        q_size = kv_size = qkv.shape[1] // 3
        q, k = qkv[:, :q_size].float(), qkv[:, q_size:q_size + kv_size].float()
        return (apply_rotary(q, self.cos, self.sin, num_heads).to(qkv.dtype),
                apply_rotary(k, self.cos, self.sin, num_kv_heads).to(qkv.dtype))


def patch_rows_and_cols(grids: list[tuple[int, int, int]], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, column) in its image, in the processor's order (merge x merge blocks, row-major inside
    and across blocks; frames repeat the grid) -> two [N] int arrays."""
    rows, cols = [], []
    for t, h, w in grids:
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows.append(np.tile(r.reshape(shape).transpose(0, 2, 1, 3).reshape(-1), t))
        cols.append(np.tile(c.reshape(shape).transpose(0, 2, 1, 3).reshape(-1), t))
    return np.concatenate(rows), np.concatenate(cols)


class Qwen2VisionTower(DirectCall, nn.Module):
    """Qwen2-VL's ViT (LayerNorm, quick-GELU MLP); ``Qwen25VisionTower`` changes the layers and the attention plan."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self._build(cfg, dtype, int(cfg.embed_dim), int(cfg.num_heads), int(cfg.hidden_size), LayerNorm)
        layer_cfg = SimpleNamespace(hidden_size=self.embed_dim, num_attention_heads=int(cfg.num_heads),
                                    layer_norm_eps=1e-6, intermediate_size=int(self.embed_dim * cfg.mlp_ratio),
                                    hidden_act=cfg.hidden_act)
        self.layers = nn.ModuleList(VisionEncoderLayer(layer_cfg, i, dtype, "visual.layers")
                                    for i in range(cfg.depth))

    def _build(self, cfg: Any, dtype: torch.dtype, d: int, heads: int, out: int, norm: type[nn.Module]) -> None:
        """The parts both generations share: patch projection, rotary frequencies, merger (``norm`` its ln_q)."""
        self.embed_dim, self.merge = d, int(cfg.spatial_merge_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, d, (cfg.temporal_patch_size, cfg.patch_size,
                                                               cfg.patch_size), bias=False, dtype=dtype)
        head_dim = d // heads
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2
        # [D/4], built on the CPU even when the model is constructed on the meta device
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu") / spatial))
        self.merger = nn.Module()
        self.merger.ln_q = norm(d, 1e-6, dtype)
        wide = d * self.merge ** 2
        self.merger.mlp = nn.ModuleList([
            make_linear(wide, wide, bias=True, dtype=dtype, prefix="visual.merger.mlp.0"), nn.Identity(),
            make_linear(wide, out, bias=True, dtype=dtype, prefix="visual.merger.mlp.2")])

    def rope(self, grids: list[tuple[int, int, int]], device: torch.device,
             order: torch.Tensor | None = None) -> VisionRope:
        rows, cols = patch_rows_and_cols(grids, self.merge)
        freq = self.inv_freq.to(device)
        angles = torch.cat([torch.from_numpy(rows).to(device)[:, None].float() * freq,
                            torch.from_numpy(cols).to(device)[:, None].float() * freq], dim=-1)  # [N, D/2]
        if order is not None:
            angles = angles[order.to(device)]
        return VisionRope(angles.cos().unsqueeze(1), angles.sin().unsqueeze(1))

    def attention_plan(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor | None, list[list[int]]]:
        """(the order patches are attended in, or None: the processor's; each layer's sequence lengths)."""
        frames = [h * w for t, h, w in grids for _ in range(t)]  # each frame one bidirectional sequence
        return None, [frames] * len(self.layers)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches: [N, C * temporal * p * p] (the processor's rows, all images), grids: (t, h, w) patches of each
        -> merged embeddings [N / merge^2, text hidden], in the processor's order."""
        weight = self.patch_embed.proj.weight
        x = F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))  # the Conv3d: one patch each
        order, layer_lens = self.attention_plan(grids)
        if order is not None:
            x = x[order.to(x.device)]
        x = run_vision_layers(self, self.layers, x.contiguous(), layer_lens[0], self.rope(grids, x.device, order),
                              layer_lens)
        x = self.merger.ln_q(x).reshape(-1, self.embed_dim * self.merge ** 2)
        fc1, _, fc2 = self.merger.mlp
        h = fc1.forward_activation(x, "gelu")
        x = fc2(h if h is not None else F.gelu(fc1(x)))
        if order is not None:  # back to the processor's order, one merged token per merge x merge block
            units = order.view(-1, self.merge ** 2)[:, 0] // self.merge ** 2
            x = x[torch.argsort(units).to(x.device)]
        return x


class Qwen2VLForConditionalGeneration(ImageTextLM):
    """``forward(input_ids, positions, inputs_embeds=None)``: the decoder step, positions [T] or [3, T] (M-RoPE);
    ``embed_images`` the vision part; ``mrope_positions`` a prompt's text positions."""

    supports_multimodal = True
    uses_mrope = True
    checkpoint_prefixes = _PREFIXES
    vision_tower_class: type[Qwen2VisionTower] = Qwen2VisionTower
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, skip=("rotary_emb.inv_freq",))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        text, vision = hf_config.text_config, hf_config.vision_config
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(vision.spatial_merge_size)
        self.visual = self.vision_tower_class(vision, dtype)
        self.model = MRopeLlamaModel(text, Qwen2ForCausalLM, dtype, quant_config)
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))  # the top-level flag
        self._init_head(text, dtype, quant_config)

    def _grid(self, image: dict[str, np.ndarray]) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in np.asarray(image["image_grid_thw"]).reshape(-1)[:3])
        return t, h, w

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each image's processor output ({"pixel_values": [patches, C * 2 * p * p], "image_grid_thw": [1, 3]})
        -> its embeddings [patches / merge^2, text hidden]; all images in one tower call."""
        device = self.embedding().weight.device
        grids = [self._grid(image) for image in images]
        patches = torch.cat([torch.as_tensor(np.asarray(image["pixel_values"])) for image in images])
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"image: {patches.shape[0]} patch rows for grids {grids}")
        embeds = self.visual(patches.to(device), grids)
        return list(embeds.split([t * h * w // self.merge ** 2 for t, h, w in grids]))

    def mrope_positions(self, num_tokens: int, features: list[Any]) -> tuple[np.ndarray, int]:
        """A prompt of ``num_tokens`` with these image features -> (positions [3, num_tokens], decode delta)."""
        spans = []
        for feature in features:
            t, h, w = self._grid(feature.data)
            spans.append((feature.offset, t, h // self.merge, w // self.merge))
        return prompt_positions(num_tokens, spans)

    def our_name(self, name: str) -> str | None:
        name = super().our_name(name)
        if name.startswith("visual."):
            for old, new in _VISION_RENAMES:
                name = name.replace(old, new)
        return name
