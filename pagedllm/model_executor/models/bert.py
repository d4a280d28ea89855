"""Encoder-only BERT (all-MiniLM-L6-v2, bge, e5 ...) on a flat batch, for embeddings.

Post-LayerNorm transformer with learned absolute positions and token types, bidirectional attention within
each sequence, no KV cache: the model runner hands it whole prompts only, and it reads where each one
starts from the step's attention metadata (``query_start_loc_cpu``). Parameter names mirror HF's
``BertModel`` except the fused q/k/v projection.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.forward_context import get_attn_metadata
from pagedllm.model_executor.layers.encoder_attention import encoder_attention_qkv, plan_encoder_attention
from pagedllm.model_executor.layers.linear import Linear

_QKV_RE = re.compile(r"\.attention\.self\.(query|key|value)\.")
_QKV_SHARD = {"query": 0, "key": 1, "value": 2}
# Checkpoint tensors an embedding model does not use: HF's tanh pooler, MLM/NSP heads, cached position ids.
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")


def _activation(name: str) -> Any:
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act {name!r} is not supported for BERT (gelu, gelu_new, relu)")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]  # one sentence: every token is type 0
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, plan: Any) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (before the output projection)."""
        qkv = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        return encoder_attention_qkv(qkv, plan)


class BertAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, dtype)
        self.output = BertAddNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, plan: Any) -> torch.Tensor:
        return self.output(self.self(x, plan), x)


class BertAddNorm(nn.Module):
    """LayerNorm(dense(x) + residual): BERT's post-norm sublayer output (HF ``BertSelfOutput``/``BertOutput``)."""

    def __init__(self, in_features: int, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden_size, bias=True, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype)
        self.act = _activation(getattr(cfg, "hidden_act", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, dtype)
        self.intermediate = BertIntermediate(cfg, dtype)
        self.output = BertAddNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, plan: Any) -> torch.Tensor:
        x = self.attention(x, plan)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """BERT encoder returning the last hidden states; pooling happens in the model runner's pooler."""

    is_encoder_only = True  # no KV cache; whole prompts in one step
    default_pooling_type = "CLS"  # when the folder has no sentence-transformers pooling config

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("quantization: not supported for BERT models")
        pos_type = getattr(hf_config, "position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(f"position_embedding_type {pos_type!r} is not supported (only absolute)")
        self.config = hf_config
        self.dtype = dtype
        self.embeddings = BertEmbeddings(hf_config, dtype)
        self.encoder = BertEncoder(hf_config, dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (0-based within each sequence), token_type_ids: [T] int64 -> [T, hidden].

        Must run inside ``forward_context(metadata)``; only ``metadata.query_start_loc_cpu`` is read.
        """
        # Which tokens attend to which: worked out once per step, shared by all layers.
        plan = plan_encoder_attention(get_attn_metadata().query_start_loc_cpu, input_ids.device)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, plan)
        return x

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (optionally under a ``bert.`` prefix) into our parameters."""
        params = dict(self.named_parameters())
        hidden = self.config.hidden_size
        loaded: set[str] = set()
        qkv_shards: dict[str, int] = {}
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_UNUSED):
                continue
            match = _QKV_RE.search(name)
            if match:
                target = name.replace(f".{match.group(1)}.", ".qkv_proj.")
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter {target!r}")
                _copy(param.data.narrow(0, _QKV_SHARD[match.group(1)] * hidden, hidden), tensor, name)
                qkv_shards[target] = qkv_shards.get(target, 0) + 1
                if qkv_shards[target] == 3:
                    loaded.add(target)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} does not match any parameter of BertModel")
            _copy(param.data, tensor, name)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return loaded


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(src.shape)}, model {tuple(dest.shape)}")
    dest.copy_(src)
