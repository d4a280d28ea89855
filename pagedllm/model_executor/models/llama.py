"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral without sliding window) on flat tokens.

The model sees one flat batch per step: ``input_ids[T]`` and ``positions[T]``, no batch dim and no
padding. Attention reads its per-step metadata from the forward context and its K/V from the paged cache.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.kernels.cpu import kernels_for
from pagedllm.model_executor.layers.activation import silu_and_mul
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.quantization.base import to_empty_keeping_loaders
from pagedllm.model_executor.layers.rotary_embedding import RopeStep, RotaryEmbedding, rope_settings

# HF checkpoint name fragment -> (our fused parameter fragment, shard index within it).
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_STACKED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        # One matmul for q, k and v: rows [q | k | v].
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype,
                               quant_config=quant_config, shard_sizes=(self.q_size, self.kv_size, self.kv_size),
                               prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=bias, dtype=dtype, quant_config=quant_config,
                             prefix=f"{prefix}.o_proj")
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              layer_idx=layer_idx)

    def forward(self, x: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(x)
        q, k = rope.rotate_qk(qkv, self.num_heads, self.num_kv_heads)
        v = qkv[:, self.q_size + self.kv_size:]
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.intermediate_size = cfg.intermediate_size
        # One matmul for gate and up: rows [gate | up].
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias, dtype=dtype,
                                   quant_config=quant_config,
                                   shard_sizes=(cfg.intermediate_size, cfg.intermediate_size),
                                   prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias, dtype=dtype,
                                quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (SwiGLU)."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(cfg, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeStep) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, hidden]; returns this layer's output and the residual stream (not yet summed)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype, quant_config, f"model.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        theta, scaling = rope_settings(cfg)
        self.rotary_emb = RotaryEmbedding(_head_dim(cfg), cfg.max_position_embeddings, theta, scaling, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = RopeStep(self.rotary_emb, positions)  # once per step, shared by all layers
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Causal LM head over ``LlamaModel``; parameter names mirror HF's except the fused projections."""

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.quant_config = quant_config
        self.model = LlamaModel(hf_config, dtype, quant_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False, dtype=dtype,
                                  quant_config=quant_config, prefix="lm_head")
        # The tied head's own copy of the embedding rows, packed or quantized (the embedding keeps reading
        # the plain rows); built by process_weights_after_loading.
        self._tied_head: Linear | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size] (model dtype).

        Must run inside ``forward_context(attn_metadata)`` with KV caches bound (``bind_kv_caches``).
        """
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden_size] (usually only the rows that sample) -> logits [N, vocab] float32.

        ``out``: an optional [N, vocab] float32 buffer the CPU kernel writes into (the result is then
        ``out``); other paths allocate.
        """
        if self.lm_head is not None:
            return self.lm_head(hidden, out=out).float()
        if self._tied_head is not None:
            return self._tied_head(hidden, out=out).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def process_weights_after_loading(self) -> None:
        """After loading: the tied LM head as its own ``Linear`` (packed fp32 copy or quantized) when that
        pays, i.e. where the CPU kernels run or a quantization scheme applies."""
        if not self.tie_word_embeddings or self._tied_head is not None:
            return
        embedding = self.model.embed_tokens.weight
        if self.quant_config is None and kernels_for(embedding) is None:
            return  # plain F.linear on the embedding rows: no second copy
        with torch.device("meta"):  # no random init of a vocab-sized matrix that is overwritten next
            head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False, dtype=embedding.dtype,
                          quant_config=self.quant_config, prefix="lm_head")
        head = to_empty_keeping_loaders(head, embedding.device)
        head.weight.weight_loader(head.weight, embedding.detach())
        head.process_weights_after_loading()
        self._tied_head = head

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...) into our parameters.

        q/k/v and gate/up land in row slices of the fused projections. Returns the names of our parameters
        that were filled; raises if a parameter was never filled or a name is unknown.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        filled_shards: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            match = _STACKED_RE.search(name)
            shard_id = None
            target = name
            if match:
                fused_name, shard_id = _STACKED[match.group(1)]
                target = name.replace(match.group(1), fused_name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} does not match any parameter of "
                                 f"{type(self).__name__}" + (f" (expected {target!r})" if match else ""))
            loader = getattr(param, "weight_loader", _default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"loading {name!r}: {e}") from e
            if shard_id is None:
                loaded.add(target)
                continue
            filled_shards[target] = filled_shards.get(target, 0) + 1
            if filled_shards[target] == len(self.get_submodule(target.rsplit(".", 1)[0]).shard_sizes):
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            more = " ..." if len(missing) > 8 else ""
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}{more}")
        return loaded


def _default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """Whole-tensor copy for parameters without their own loader (embeddings, norms)."""
    if shard_id is not None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has no shards (got shard {shard_id})")
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}")
    param.data.copy_(loaded)
