"""Encoder-only BERT (all-MiniLM-L6-v2, bge, e5 ...) on a flat batch, for embeddings.

Post-LayerNorm transformer with learned absolute positions and token types, bidirectional attention within
each sequence (the shared ``Attention`` layer with ``AttentionSpec.encoder()``), no KV cache: the model
runner hands it whole prompts only. Parameter names mirror HF's ``BertModel`` except the fused q/k/v
projection.

Precision: the matmuls (and attention) run in the model dtype, the residual stream, the LayerNorms and the
embedding sums in float32. In bfloat16 that keeps the vectors within cosine ~0.99997 of the float32 model
(all-bf16: ~0.99991) at the speed of the bf16 matmuls, which are nearly all of the work.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.spec import AttentionSpec
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.kernel_binding import KernelBinding
from pagedllm.model_executor.layers.linear import Linear

_QKV_RE = re.compile(r"\.attention\.self\.(query|key|value)\.")
_QKV_SHARD = {"query": 0, "key": 1, "value": 2}
# Checkpoint tensors an embedding model does not use: HF's tanh pooler, MLM/NSP heads, cached position ids.
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")


_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _activation_kind(name: str) -> str:
    """The config's ``hidden_act`` as ``Linear.forward_activation`` names it."""
    if name == "gelu" or name == "relu":
        return name
    if name in _TANH_GELUS:
        return "gelu_tanh"
    raise ValueError(f"hidden_act {name!r} is not supported for BERT (gelu, gelu_new, relu)")


def _activation(name: str) -> Any:
    """The activation, applied in place to the intermediate projection's fresh output."""
    if name in ("gelu", *_TANH_GELUS):
        tanh = name != "gelu"
        cpu_kernels = _cpu_kernels()

        def gelu_(x: torch.Tensor) -> torch.Tensor:
            kernels = cpu_kernels(x)
            if kernels is None:
                return F.gelu(x, approximate="tanh" if tanh else "none")
            kernels.gelu_(x, tanh)
            return x

        return gelu_
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act {name!r} is not supported for BERT (gelu, gelu_new, relu)")


def _cpu_kernels() -> KernelBinding:
    """One layer's C++ kernels for float32 / bfloat16 CPU tensors (encoder_ops.cpp), else None; bound at its
    first call."""
    return KernelBinding(lambda platform, dtype: platform.cpu_kernels_family(dtype, (torch.float32, torch.bfloat16)))


class BertEmbeddings(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """-> [T, hidden] float32 (the residual stream's dtype)."""
        x = self.word_embeddings(input_ids).float() + self.position_embeddings(positions)
        if token_type_ids is None:
            x += self.token_type_embeddings.weight[0]  # one sentence: every token is type 0
        else:
            x += self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        head_dim = hidden // cfg.num_attention_heads
        self.hidden_size = hidden
        self.qkv_proj = Linear(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.attn = Attention(cfg.num_attention_heads, head_dim, head_dim ** -0.5, layer_idx=layer_idx,
                              spec=AttentionSpec.encoder())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] in the model dtype -> [T, hidden] (before the output projection)."""
        q, k, v = self.qkv_proj(x).split(self.hidden_size, dim=-1)
        return self.attn(q, k, v)


class BertAttention(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, dtype, layer_idx)
        self.output = BertAddNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, x_low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] float32 residual; x_low: the same in the model dtype -> (float32, model dtype)."""
        return self.output(self.self(x_low), x)


class BertAddNorm(DirectCall, nn.Module):
    """LayerNorm(dense(x) + residual): BERT's post-norm sublayer output (HF ``BertSelfOutput``/``BertOutput``).
    The sum and the norm are float32 whatever the matmul's dtype."""

    def __init__(self, in_features: int, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.dense = Linear(in_features, hidden_size, bias=True, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps, dtype=torch.float32)
        self._kernels = _cpu_kernels()

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, in] model dtype; residual: [T, hidden] float32 -> the output [T, hidden] in float32 and in
        the model dtype (what the next matmul reads): one fused pass on CPU."""
        y = self.dense(x)
        kernels = self._kernels(y)
        if kernels is not None:
            norm = self.LayerNorm
            return kernels.add_layer_norm(y, residual, norm.weight, norm.bias, norm.eps, self.dtype == torch.bfloat16)
        out = self.LayerNorm(residual + y)  # type promotion: the sum is float32
        return out, out.to(self.dtype)


class BertIntermediate(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype)
        act = getattr(cfg, "hidden_act", "gelu")
        self.act_kind = _activation_kind(act)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] model dtype -> act(dense(x)) [T, intermediate], fused into the matmul where it can be."""
        y = self.dense.forward_activation(x, self.act_kind)
        return y if y is not None else self.act(self.dense(x))


class BertLayer(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, dtype, layer_idx)
        self.intermediate = BertIntermediate(cfg, dtype)
        self.output = BertAddNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, x_low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] float32, x_low: the same in the model dtype -> the layer's output, both ways."""
        x, x_low = self.attention(x, x_low)
        return self.output(self.intermediate(x_low), x)


class BertEncoder(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, dtype, i) for i in range(cfg.num_hidden_layers))


class BertModel(DirectCall, nn.Module):
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
        """input_ids, positions (0-based within each sequence), token_type_ids: [T] int64 -> [T, hidden]
        float32.

        Must run inside ``forward_context(metadata)``; the encoder attention reads where each sequence
        starts (``query_start_loc_cpu``) and plans its buckets once per step.
        """
        x = self.embeddings(input_ids, positions, token_type_ids)
        x_low = x.to(self.dtype)
        for layer in self.encoder.layer:
            x, x_low = layer(x, x_low)
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
