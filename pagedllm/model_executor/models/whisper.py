"""Whisper (speech to text): an audio encoder, and a text decoder that cross-attends to its output.

    log-mel [n_mels, 3000] -> conv (k3) -> gelu -> conv (k3, stride 2) -> gelu -> + sinusoidal positions
        -> [ LN -> self-attention (bidirectional) -> + -> LN -> MLP (gelu) -> + ] x N_enc -> LN   (1500 positions)
    tokens -> embed + learned positions
        -> [ LN -> self-attention (causal, paged) -> + -> LN -> cross-attention (encoder K/V) -> +
             -> LN -> MLP (gelu) -> + ] x N_dec -> LN -> head (tied to the embedding)

The engine runs the encoder once per request (``encode``, batched over the requests admitted in a step) and
writes each decoder layer's cross-attention K/V of it into the cross-attention KV cache group
(``write_cross_kv``); every decoder step (``forward``) then reads them through that group's block tables.
q/k/v of a self-attention are one fused projection (transformers' k has no bias: its rows of the fused bias stay
zero), the cross-attention's k/v another. Weights load from transformers' names; a CTranslate2 folder's are
renamed to those by ``loader/ct2_whisper.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.model_executor.layers.attention import Attention, attention_step, step_readers
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import LayerNorm
from pagedllm.model_executor.models.base import CausalLM
from pagedllm.model_executor.models.blocks import RotaryAttention, make_linear
from pagedllm.model_executor.models.weight_loading import WeightMapping

# Encoder layers keep no KV cache; their layer_idx sits past every cached layer's.
ENCODER_LAYER_IDX_BASE = 1 << 16
LAYER_NORM_EPS = 1e-5


class TimeMajorConv1d(nn.Conv1d):
    """``nn.Conv1d`` (its parameters and names) run as one matmul on time-major input, each output step's
    ``kernel_size`` input frames gathered by ``unfold``. On Whisper's shapes faster than oneDNN's convolution
    (which first copies its input into another layout), in bf16 and float32 (figures: docs/performance.md); the
    output comes out [time, channels], the layout the encoder layers read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.groups != 1 or self.dilation != (1,) or self.padding_mode != "zeros":
            raise ValueError("TimeMajorConv1d: only groups=1, dilation=1, zero padding")
        self.taps: torch.Tensor | None = None  # [out, kernel_size * in], tap-major rows of the weight

    def process_weights_after_loading(self) -> None:
        self.taps = self._taps()

    def _taps(self) -> torch.Tensor:
        out_channels, in_channels, k = self.weight.shape
        return self.weight.detach().permute(0, 2, 1).reshape(out_channels, k * in_channels).contiguous()

    def forward_time_major(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, T, C_in] -> [n, T_out, C_out]."""
        (pad,), (stride,), (k,) = self.padding, self.stride, self.kernel_size
        frames = F.pad(x, (0, 0, pad, pad)).unfold(1, k, stride)  # [n, T_out, C_in, k]
        n, steps = frames.shape[:2]
        taps = self.taps if self.taps is not None else self._taps()  # a model built without the loader
        return F.linear(frames.transpose(2, 3).reshape(n * steps, -1), taps, self.bias).view(n, steps, -1)


class WhisperMLP(DirectCall, nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, act: str, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        if act != "gelu":
            raise ValueError(f"Whisper: activation_function {act!r} is not supported (gelu)")
        self.fc1 = make_linear(d_model, ffn_dim, bias=True, dtype=dtype, prefix=f"{prefix}.fc1")
        self.fc2 = make_linear(ffn_dim, d_model, bias=True, dtype=dtype, prefix=f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, d] -> [T, d]."""
        h = self.fc1.forward_activation(x, "gelu")
        if h is None:
            h = F.gelu(self.fc1(x))
        return self.fc2(h)


class WhisperCrossAttention(DirectCall, nn.Module):
    """q from the decoder, k/v (fused) from the encoder output; the K/V live in the cross-attention group."""

    def __init__(self, d_model: int, num_heads: int, *, layer_idx: int, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.query_proj = make_linear(d_model, d_model, bias=True, dtype=dtype, prefix=f"{prefix}.query_proj")
        self.kv_proj = make_linear(d_model, 2 * d_model, bias=True, dtype=dtype, shard_sizes=(d_model, d_model),
                                   prefix=f"{prefix}.kv_proj")
        self.o_proj = make_linear(d_model, d_model, bias=True, dtype=dtype, prefix=f"{prefix}.o_proj")
        self.attn = Attention(num_heads, self.head_dim, self.head_dim ** -0.5, num_heads, layer_idx=layer_idx,
                              spec=AttentionSpec.cross())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, d] -> [T, d] (the step's K/V are in the cache already)."""
        return self.o_proj(self.attn(self.query_proj(x), None, None))

    def write_kv(self, encoder_hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """encoder_hidden: [N, d] -> this layer's K/V at ``slot_mapping`` [N] int64 of its cache."""
        kv = self.kv_proj(encoder_hidden)
        d = kv.shape[1] // 2
        self.attn.write_kv(kv[:, :d], kv[:, d:], slot_mapping)


class WhisperEncoderLayer(DirectCall, nn.Module):
    def __init__(self, cfg: Any, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = cfg.d_model, cfg.encoder_attention_heads
        prefix = f"model.encoder.layers.{i}"
        self.self_attn_layer_norm = LayerNorm(d, LAYER_NORM_EPS, dtype)
        self.self_attn = RotaryAttention(d, heads, heads, d // heads, layer_idx=ENCODER_LAYER_IDX_BASE + i,
                                         dtype=dtype, spec=AttentionSpec.encoder(), qkv_bias=True, o_bias=True,
                                         prefix=f"{prefix}.self_attn")
        self.final_layer_norm = LayerNorm(d, LAYER_NORM_EPS, dtype)
        self.mlp = WhisperMLP(d, cfg.encoder_ffn_dim, cfg.activation_function, dtype, prefix)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings, with ``residual`` None) -> (this layer's MLP output,
        the residual stream before it): each add is fused into the norm after it (``LayerNorm(x, residual)``)."""
        if residual is None:
            h, residual = self.self_attn_layer_norm(x), x
        else:
            h, residual = self.self_attn_layer_norm(x, residual)
        h, residual = self.final_layer_norm(self.self_attn(h, None), residual)
        return self.mlp(h), residual


class WhisperDecoderLayer(DirectCall, nn.Module):
    def __init__(self, cfg: Any, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = cfg.d_model, cfg.decoder_attention_heads
        prefix = f"model.decoder.layers.{i}"
        self.self_attn_layer_norm = LayerNorm(d, LAYER_NORM_EPS, dtype)
        self.self_attn = RotaryAttention(d, heads, heads, d // heads, layer_idx=i, dtype=dtype,
                                         spec=AttentionSpec.causal(), qkv_bias=True, o_bias=True,
                                         prefix=f"{prefix}.self_attn")
        self.encoder_attn_layer_norm = LayerNorm(d, LAYER_NORM_EPS, dtype)
        self.encoder_attn = WhisperCrossAttention(d, heads, layer_idx=cfg.decoder_layers + i, dtype=dtype,
                                                  prefix=f"{prefix}.encoder_attn")
        self.final_layer_norm = LayerNorm(d, LAYER_NORM_EPS, dtype)
        self.mlp = WhisperMLP(d, cfg.decoder_ffn_dim, cfg.activation_function, dtype, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), None)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x))
        return x + self.mlp(self.final_layer_norm(x))


class WhisperEncoder(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_positions = int(cfg.max_source_positions)
        self.conv1 = TimeMajorConv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = TimeMajorConv1d(d, d, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.embed_positions = nn.Embedding(self.num_positions, d, dtype=dtype)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg, i, dtype) for i in range(cfg.encoder_layers))
        self.layer_norm = LayerNorm(d, LAYER_NORM_EPS, dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features: [n, n_mels, 2 * P] log-mel -> [n * P, d] encoder states (P = 1500 positions each)."""
        x = F.gelu(self.conv1.forward_time_major(features.transpose(1, 2)))
        x = F.gelu(self.conv2.forward_time_major(x))  # [n, P, d]
        n = x.shape[0]
        if x.shape[1] != self.num_positions:
            raise ValueError(f"audio_features: {features.shape[2]} frames give {x.shape[1]} encoder positions; "
                             f"Whisper takes {2 * self.num_positions} frames (30 s)")
        # Row-major [n * P, d] from here: the layers' adds and norms run several times slower on a transposed stream
        # (docs/performance.md).
        x = (x + self.embed_positions.weight).view(n * self.num_positions, -1)
        lens = [self.num_positions] * n
        meta = build_attention_metadata(lens, lens, np.zeros((n, 1), dtype=np.int32), 1, x.device)
        residual = None
        # n whole sequences, bidirectional: the encoder attention path, its step prepared like any other.
        with attention_step(meta, step_readers(self)):
            for layer in self.layers:
                x, residual = layer(x, residual)
        return self.layer_norm(x, residual)[0]


class WhisperDecoder(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.d_model
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d, dtype=dtype)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, d, dtype=dtype)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, i, dtype) for i in range(cfg.decoder_layers))
        self.layer_norm = LayerNorm(d, LAYER_NORM_EPS, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperModel(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(cfg, dtype)
        self.decoder = WhisperDecoder(cfg, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)


def _with_zero_k_biases(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' k projections have no bias; the fused layers' k rows of the bias load as zeros."""
    for name, tensor in weights:
        yield name, tensor
        if name.endswith(".k_proj.weight"):
            yield name[:-len("weight")] + "bias", torch.zeros(tensor.shape[0], dtype=tensor.dtype)


class WhisperForConditionalGeneration(CausalLM):
    """The engine's Whisper. ``forward(input_ids, positions)`` is the decoder step; ``encode`` +
    ``write_cross_kv`` the once-per-request encoder work (``worker/encoder_decoder.py`` calls them)."""

    is_encoder_decoder = True
    embedding_name = "model.decoder.embed_tokens"
    head_name = "proj_out.weight"
    weight_mapping = WeightMapping(
        renames=(("self_attn.out_proj.", "self_attn.o_proj."), ("encoder_attn.out_proj.", "encoder_attn.o_proj."),
                 ("encoder_attn.q_proj.", "encoder_attn.query_proj."),
                 (".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2.")),
        stacked=(("encoder_attn.k_proj", "encoder_attn.kv_proj", 0), ("encoder_attn.v_proj", "encoder_attn.kv_proj", 1),
                 ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2)))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("quantization: Whisper runs unquantized (float32, bfloat16 or float16)")
        hf_config.tie_word_embeddings = True  # Whisper's proj_out is always the token embedding
        self.model = WhisperModel(hf_config, dtype)
        self.encoder_positions = int(hf_config.max_source_positions)
        self._init_head(hf_config, dtype)

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """features: [n, n_mels, 3000] -> encoder states [n * 1500, d_model]."""
        return self.model.encoder(features.to(self.dtype))

    @torch.inference_mode()
    def write_cross_kv(self, encoder_hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Every decoder layer's cross-attention K/V of ``encoder_hidden`` [N, d] into the cross-attention group
        at ``slot_mapping`` [N] int64."""
        for layer in self.model.decoder.layers:
            layer.encoder_attn.write_kv(encoder_hidden, slot_mapping)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """transformers-named tensors (an HF folder's, or a CTranslate2 folder's renamed). ``stacked`` lists the
        cross-attention's k/v first (the first match wins), and its q is renamed before: neither may be taken for
        the self-attention's fused q/k/v."""
        return super().load_weights(_with_zero_k_biases(weights))
