"""The CLIP vision transformer (LLaVA's vision tower) in pagedllm's layers.

    pixels [n, 3, H, W] -> patch conv (no bias) -> [CLS] + patches + learned positions -> LN (pre)
        -> [ LN -> self-attention (bidirectional, per image) -> + -> LN -> MLP -> + ] x L

Attention is the shared ``Attention`` layer on its encoder path (``AttentionSpec.encoder()``: no KV cache, each image
one sequence), the path BERT and Whisper's encoder take, with metadata built here for the batch of images. Only
the layers a VLM reads run (``num_layers``: LLaVA takes the second-to-last layer's output by default), and the
post-LayerNorm, which no LLaVA reads, is not built. Names follow transformers' ``CLIPVisionModel`` under
``vision_tower.`` except the fused q/k/v projection and ``o_proj``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.model_executor.layers.attention import attention_step, step_readers
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.kernel_binding import KernelBinding
from pagedllm.model_executor.layers.layernorm import LayerNorm
from pagedllm.model_executor.models.blocks import RotaryAttention, make_linear

# Vision layers keep no KV cache; their layer_idx sits past every cached layer's (and Whisper's encoder's).
VISION_LAYER_IDX_BASE = 1 << 17


_GELUS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def vision_activation_kind(name: str) -> str:
    """The config's ``hidden_act`` as ``Linear.forward_activation`` names it ("quick_gelu" has no fused form)."""
    if name == "quick_gelu":
        return name
    if name not in _GELUS:
        raise ValueError(f"vision hidden_act {name!r} is not supported (quick_gelu, gelu, gelu_pytorch_tanh)")
    return _GELUS[name]


def vision_activation(name: str) -> Any:
    """The vision MLP's activation by its config name, applied in place to fc1's fresh output (the C++ GELU on
    float32 / bfloat16 CPU tensors, one pass in place; docs/performance.md has what it saves)."""
    kind = vision_activation_kind(name)
    if kind == "quick_gelu":
        return lambda x: x.mul_(torch.sigmoid(1.702 * x))
    tanh = kind == "gelu_tanh"
    cpu_kernels = KernelBinding(lambda platform, dtype: platform.cpu_kernels_family(dtype, (torch.float32,
                                                                                            torch.bfloat16)))

    def gelu_(x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels(x)
        if kernels is None:
            return F.gelu(x, approximate="tanh" if tanh else "none")
        kernels.gelu_(x, tanh)
        return x

    return gelu_


def layers_for_feature_layer(feature_layer: int, num_hidden_layers: int) -> int:
    """Encoder layers to run so that the last output is transformers' ``hidden_states[feature_layer]`` (index 0
    is the embeddings after the pre-LayerNorm)."""
    count = feature_layer if feature_layer >= 0 else num_hidden_layers + 1 + feature_layer
    if not 0 <= count <= num_hidden_layers:
        raise ValueError(f"vision_feature_layer {feature_layer} is outside the vision tower's "
                         f"{num_hidden_layers} layers")
    return count


class VisionMLP(DirectCall, nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.fc1 = make_linear(hidden, intermediate, bias=True, dtype=dtype, prefix=f"{prefix}.fc1")
        self.fc2 = make_linear(intermediate, hidden, bias=True, dtype=dtype, prefix=f"{prefix}.fc2")
        self.act_kind = vision_activation_kind(act)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; the activation fused into fc1's matmul where its weight can (oneDNN's
        bf16 post-op)."""
        h = self.fc1.forward_activation(x, self.act_kind) if self.act_kind != "quick_gelu" else None
        return self.fc2(h if h is not None else self.act(self.fc1(x)))


class VisionEncoderLayer(DirectCall, nn.Module):
    """A pre-norm ViT layer as CLIP and SigLIP have it (their parameter names)."""

    def __init__(self, cfg: Any, i: int, dtype: torch.dtype, prefix: str = "vision_tower.encoder.layers") -> None:
        super().__init__()
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        prefix = f"{prefix}.{i}"
        self.layer_norm1 = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.self_attn = RotaryAttention(d, heads, heads, d // heads, layer_idx=VISION_LAYER_IDX_BASE + i,
                                         dtype=dtype, spec=AttentionSpec.encoder(), qkv_bias=True, o_bias=True,
                                         prefix=f"{prefix}.self_attn")
        self.layer_norm2 = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.mlp = VisionMLP(d, cfg.intermediate_size, cfg.hidden_act, dtype, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, d] (all images' tokens, flat) residual stream; pending: the previous layer's MLP output not yet
        added to it (None for the first layer) -> (the stream, this layer's MLP output, still to add). ``rope``:
        rotary positions of the patches (Qwen2-VL's 2D rotary), None for learned position embeddings.

        Each residual add runs in one pass with the LayerNorm after it (``LayerNorm(x, residual)``), which writes
        into both tensors: the caller hands them over."""
        if pending is None:
            h = self.layer_norm1(x)
        else:
            h, x = self.layer_norm1(pending, x)
        h, x = self.layer_norm2(self.self_attn(h, rope), x)
        return x, self.mlp(h)


class CLIPVisionEmbeddings(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.patch_size = int(cfg.patch_size)
        self.num_patches = (int(cfg.image_size) // self.patch_size) ** 2
        self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, self.patch_size, stride=self.patch_size, bias=False,
                                         dtype=dtype)
        self.position_embedding = nn.Embedding(self.num_patches + 1, d, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [n, C, H, W] (H = W = the config's image_size) -> [n, 1 + patches, d]."""
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, P, d]
        if patches.shape[1] != self.num_patches:
            raise ValueError(f"image: {tuple(pixels.shape[2:])} pixels give {patches.shape[1]} patches; the vision "
                             f"tower takes {self.num_patches} (its image processor's size)")
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTower(DirectCall, nn.Module):
    """``num_layers``: encoder layers built and run (see ``layers_for_feature_layer``)."""

    def __init__(self, cfg: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(cfg, dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)  # transformers' spelling
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, i, dtype) for i in range(num_layers))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [n, C, H, W] -> hidden states [n, 1 + patches, d] of the last layer built."""
        x = self.embeddings(pixels)
        n, seq, d = x.shape
        x = self.pre_layrnorm(x.reshape(n * seq, d))
        return run_vision_layers(self, self.layers, x, [seq] * n).view(n, seq, d)


def run_vision_layers(tower: nn.Module, layers: nn.ModuleList, x: torch.Tensor, lens: list[int],
                      rope: Any = None, layer_lens: list[list[int]] | None = None) -> torch.Tensor:
    """x: [sum(lens), d], images (tiles) of ``lens`` patches each -> [sum(lens), d] after ``layers``, each image
    one bidirectional sequence on the encoder attention path (metadata built here, as Whisper's encoder does).
    ``layer_lens``: each layer's own sequences instead (Qwen2.5-VL's windows), consecutive equal ones sharing
    one metadata."""
    plan = layer_lens or [lens] * len(layers)
    pending, i = None, 0
    readers = step_readers(tower)
    while i < len(layers):
        j = i
        while j < len(layers) and plan[j] == plan[i]:
            j += 1
        seqs = plan[i]
        meta = build_attention_metadata(seqs, seqs, np.zeros((len(seqs), 1), dtype=np.int32), 1, x.device)
        with attention_step(meta, readers):
            for layer in layers[i:j]:
                x, pending = layer(x, pending, rope)
        i = j
    return x if pending is None else x.add_(pending)
