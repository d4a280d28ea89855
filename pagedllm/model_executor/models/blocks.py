"""Building blocks shared by the decoder architectures: linear construction, gated MLP, rotary attention.

An architecture file composes these (and the norms in ``layers.layernorm``) so that it reads like its
paper's block diagram; fused q/k/v and gate/up projections are what ``weight_loading`` fills by shard.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.spec import AttentionSpec
from pagedllm.distributed.parallel_state import divide, get_tp
from pagedllm.model_executor.layers.activation import gated_activation
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.parallel_linear import (
    Slice,
    column_parallel_linear,
    even_part,
    row_parallel_linear,
)
from pagedllm.model_executor.layers.quantization.base import set_weight_loader
from pagedllm.model_executor.layers.rotary_embedding import RopeStep

_LINEAR_TAKES_QUANT = "quant_config" in inspect.signature(Linear.__init__).parameters


def make_linear(input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype, quant_config: Any = None,
                shard_sizes: tuple[int, ...] | None = None, prefix: str = "") -> Linear:
    """Every model builds its projections here: one place that knows ``Linear``'s constructor.

    ``shard_sizes``: output rows of each stacked shard of a fused layer (q, k, v or gate, up).
    """
    if _LINEAR_TAKES_QUANT:
        return Linear(input_size, output_size, bias=bias, dtype=dtype, quant_config=quant_config,
                      shard_sizes=shard_sizes, prefix=prefix)
    if quant_config is not None:
        raise ValueError("quantization: this build's Linear layer does not take a quantization config")
    layer = Linear(input_size, output_size, bias=bias, dtype=dtype)
    layer.shard_sizes = shard_sizes
    return layer


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class GatedMLP(DirectCall, nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up in one matmul (rows [gate | up])."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, *, bias: bool = False,
                 dtype: torch.dtype, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        if get_tp().is_parallel:  # gate/up by output rows, down by input columns (+ all-reduce)
            part = even_part(intermediate_size, f"{prefix}: intermediate_size")
            self.gate_up_proj = column_parallel_linear(hidden_size, (part, part), bias=bias, dtype=dtype,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
            self.down_proj = row_parallel_linear(part, hidden_size, bias=bias, dtype=dtype, quant_config=quant_config,
                                                 prefix=f"{prefix}.down_proj")
        else:
            self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype,
                                            quant_config=quant_config, shard_sizes=(intermediate_size,) * 2,
                                            prefix=f"{prefix}.gate_up_proj")
            self.down_proj = make_linear(intermediate_size, hidden_size, bias=bias, dtype=dtype,
                                         quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_and_mul = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class RotaryAttention(DirectCall, nn.Module):
    """Fused q/k/v projection, optional per-head q/k norm, rotary positions, paged attention, output proj.

    ``qk_norm``: a factory ``(head_dim) -> norm module`` (Qwen3, Gemma 3) applied per head before rotary.
    ``scale`` defaults to 1/sqrt(head_dim). A step passes ``rope=None`` for models without rotary (GPT-2).
    ``sinks``: one learned softmax-denominator logit per head (gpt-oss), ``attn.sinks``; each rank loads its heads'.
    ``qk_norm_per_head`` False: the q/k norms span the whole projection (all heads together, OLMoE), which one
    rank must hold whole. ``clip_qkv``: q, k (after their norms) and v clamped to [-clip, clip] (OLMoE).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, layer_idx: int,
                 dtype: torch.dtype, spec: AttentionSpec | None = None, scale: float | None = None,
                 qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: Callable[[int], nn.Module] | None = None, quant_config: Any = None,
                 prefix: str = "", sinks: bool = False, qk_norm_per_head: bool = True,
                 clip_qkv: float | None = None) -> None:
        super().__init__()
        first_head = 0  # this rank's first query head
        if get_tp().is_parallel and qk_norm and not qk_norm_per_head:
            raise ValueError(f"{prefix}: q/k norms over all heads together are not implemented under tensor "
                             "parallelism (use --tensor-parallel-size 1)")
        if get_tp().is_parallel:
            first_head = get_tp().rank * divide(num_heads, get_tp().world_size, f"{prefix}: num_attention_heads")
            num_heads, num_kv_heads = self._init_parallel(hidden_size, num_heads, num_kv_heads, head_dim, dtype,
                                                          qkv_bias, o_bias, quant_config, prefix)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        if not get_tp().is_parallel:
            self.qkv_proj = make_linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias, dtype=dtype,
                                        quant_config=quant_config,
                                        shard_sizes=(self.q_size, self.kv_size, self.kv_size),
                                        prefix=f"{prefix}.qkv_proj")
            self.o_proj = make_linear(self.q_size, hidden_size, bias=o_bias, dtype=dtype, quant_config=quant_config,
                                      prefix=f"{prefix}.o_proj")
        self.qk_norm_per_head, self.clip_qkv = qk_norm_per_head, clip_qkv
        self.q_norm = qk_norm(head_dim if qk_norm_per_head else self.q_size) if qk_norm else None
        self.k_norm = qk_norm(head_dim if qk_norm_per_head else self.kv_size) if qk_norm else None
        self.attn = Attention(num_heads, head_dim, scale if scale is not None else head_dim ** -0.5, num_kv_heads,
                              layer_idx=layer_idx, spec=spec, sinks=sinks)
        if sinks and get_tp().is_parallel:
            def load_sinks(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
                param.data.copy_(loaded.narrow(0, first_head, num_heads))

            set_weight_loader(self.attn.sinks, load_sinks)

    def _init_parallel(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, qkv_bias: bool, o_bias: bool, quant_config: Any,
                       prefix: str) -> tuple[int, int]:
        """This rank's heads: q heads split evenly, KV heads split or (fewer than the ranks) replicated; the
        q/k/v projection by output rows, the output projection by input columns. Returns (q heads, KV heads)."""
        tp = get_tp()
        world, rank = tp.world_size, tp.rank
        local_heads = divide(num_heads, world, f"{prefix}: num_attention_heads")
        if num_kv_heads >= world:
            local_kv = divide(num_kv_heads, world, f"{prefix}: num_key_value_heads")
            kv_head = rank * local_kv
        else:  # replicated: each KV head serves world / num_kv_heads ranks
            if world % num_kv_heads:
                raise ValueError(f"tensor_parallel_size {world} is neither a divisor nor a multiple of "
                                 f"{prefix}: num_key_value_heads ({num_kv_heads})")
            local_kv, kv_head = 1, rank * num_kv_heads // world
        d = head_dim
        q_part = Slice(rank * local_heads * d, local_heads * d, num_heads * d)
        kv_part = Slice(kv_head * d, local_kv * d, num_kv_heads * d)
        self.qkv_proj = column_parallel_linear(hidden_size, (q_part, kv_part, kv_part), bias=qkv_bias, dtype=dtype,
                                               quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = row_parallel_linear(q_part, hidden_size, bias=o_bias, dtype=dtype, quant_config=quant_config,
                                          prefix=f"{prefix}.o_proj")
        return local_heads, local_kv

    def _norm_heads_in_place(self, qkv: torch.Tensor) -> bool:
        """Per-head q/k RMSNorms (weights w, not Gemma's 1 + w) in place inside ``qkv`` [T, q + 2kv] by the C++
        kernel, where the platform has it: no copy out and back (a torch op, which would keep the decode step out of
        a CPU step graph). False: nothing done."""
        q_norm, k_norm = self.q_norm, self.k_norm
        if not (self.qk_norm_per_head and isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm)
                and not q_norm.weight_offset and qkv.dim() == 2 and q_norm.weight.dtype == qkv.dtype):
            return False
        kernels = q_norm._kernels(qkv)
        if kernels is None or not hasattr(kernels, "rms_norm_heads_"):
            return False
        kernels.rms_norm_heads_(qkv, q_norm.weight, 0, self.num_heads, q_norm.eps)
        kernels.rms_norm_heads_(qkv, k_norm.weight, self.q_size, self.num_kv_heads, k_norm.eps)
        return True

    def forward(self, x: torch.Tensor, rope: RopeStep | None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        if self.q_norm is not None and not self._norm_heads_in_place(qkv):
            d = self.head_dim if self.qk_norm_per_head else None
            q = qkv[:, :q_end] if d is None else qkv[:, :q_end].reshape(-1, d)
            k = qkv[:, q_end:k_end] if d is None else qkv[:, q_end:k_end].reshape(-1, d)
            q, k = self.q_norm(q).view(-1, self.q_size), self.k_norm(k).view(-1, self.kv_size)
            qkv = torch.cat([q, k, qkv[:, k_end:]], dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        if rope is not None and self.attn.write_kv_with_rotary(qkv, rope):
            return self.o_proj(self.attn(qkv[:, :q_end], None, None))  # CUDA: rotary wrote K/V into the cache
        if rope is not None:
            q, k = rope.rotate_qk(qkv, self.num_heads, self.num_kv_heads)
        else:
            q, k = qkv[:, :q_end], qkv[:, q_end:k_end]
        return self.o_proj(self.attn(q, k, qkv[:, k_end:]))
