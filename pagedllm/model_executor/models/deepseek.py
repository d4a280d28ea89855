"""DeepSeek-V2 / V3 (and the models built on V3's architecture: Kimi K2, Moonlight): multi-head latent attention
(MLA) and DeepSeek's routers, on Llama's decoder stack (``llama.py``).

Multi-head latent attention. Each token's keys and values come from one small latent: ``kv_a_proj_with_mqa`` gives
c [kv_lora_rank] (RMS-normed) and a shared rotary key k_pe [qk_rope_head_dim]; ``kv_b_proj`` would expand c into
every head's k_nope and v. The cache keeps the latent, not the expansion: with W_UK / W_UV the per-head blocks of
``kv_b_proj``, q_nope . k_nope = (q_nope W_UK) . c, so each query head is turned into the latent space once
(``q_lat = q_nope W_UK``) and attends, with its rotary part, to one shared KV head

    K = V-slot = [c | k_pe]   (head size kv_lora_rank + qk_rope_head_dim: 576 for V2 / V3)

(multi-query attention over the paged cache, the scale of the full qk head dim). The attention output's latent
part o [kv_lora_rank] per head is turned back by W_UV (``o W_UV^T``, [v_head_dim]) before ``o_proj``. A token
then costs 2 x 576 cached values per layer instead of heads x (192 + 128). The value slot repeats c (its rotary
tail is zeros, never read back).

DeepSeek rotates its rotary dims as interleaved pairs (x0, x1), (x2, x3), ...: the rows of the projections that
produce q_pe and k_pe are reordered at load (evens, then odds), after which the ordinary rotate-half rotary gives
the same scores (V2 always; V3 when ``rope_interleave``). YaRN's ``mscale_all_dim`` also scales the softmax
(``yarn_softmax_scale``).

Feed-forward: layers before ``first_k_dense_replace`` (and off ``moe_layer_freq``) are dense; the others route
``n_routed_experts`` experts (``layers/fused_moe``: V2 softmax, greedy or group-limited; V3 sigmoid with a score
correction bias and group limits; both scaled by ``routed_scaling_factor``) and add ``n_shared_experts`` ungated
shared experts (one MLP of their total width). The router runs in float32, as transformers does.

Tensor parallelism splits the heads: each rank projects its heads' queries (``q_proj`` / ``q_b_proj`` by rows),
holds their blocks of ``kv_b_proj`` and its columns of ``o_proj`` (one all-reduce); the latent projections and the
cached latent are the same on every rank (a rank caches one latent head, as one rank does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.spec import AttentionSpec
from pagedllm.distributed.parallel_state import divide, get_tp
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.parallel_linear import Slice, column_parallel_linear, row_parallel_linear
from pagedllm.model_executor.layers.quantization.base import set_weight_loader
from pagedllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
from pagedllm.model_executor.layers.rotary_embedding import RopeStep, rope_settings, rope_type_of
from pagedllm.model_executor.models.blocks import GatedMLP, make_linear
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_loading import STACKED_EXPERTS, WeightMapping, beyond_the_decoder

# transformers builds the latent norms with RMSNorm's default epsilon, not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
_GATE_UP = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


def yarn_softmax_scale(cfg: Any, head_dim: int) -> float:
    """1/sqrt(head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (the non-rotary dims scale too)."""
    scale = head_dim ** -0.5
    _, scaling = rope_settings(cfg)
    m_all = scaling.get("mscale_all_dim")
    if rope_type_of(scaling) != "default" and m_all:
        factor = float(scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentUpProjection(nn.Module):
    """``kv_b_proj`` [H * (qk_nope + v), kv_lora_rank] (this rank's heads [first_head, first_head + num_heads)),
    kept in float and split once loaded into ``w_uk`` [H, qk_nope, r] (keys' up-projection, folded into the
    queries) and ``w_uv_t`` [H, r, v] (values'). From an fp8 checkpoint (``quant_config`` fp8 with its scales:
    ``weight_scale_inv`` blocks or ``weight_scale``) the float8 values are scaled back to float once loaded."""

    def __init__(self, rank: int, num_heads: int, nope: int, v: int, dtype: torch.dtype, first_head: int = 0,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.num_heads, self.nope, self.v, self.prefix = num_heads, nope, v, prefix
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), rank, dtype=dtype), requires_grad=False)
        rows = Slice(first_head * (nope + v), num_heads * (nope + v), 0)

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            part = loaded.narrow(0, rows.start, rows.size) if loaded.shape[0] > rows.size else loaded
            if part.shape != param.shape:
                raise ValueError(f"checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)} for this rank's heads")
            param.data.copy_(part.float() if part.dtype == torch.float8_e4m3fn else part)  # fp8 -> float is exact

        set_weight_loader(self.weight, load)
        # An fp8 checkpoint's scale: kept whole until the weight is scaled (the rows of other ranks cut then).
        self._fp8_block: tuple[int, int] | None = None
        self._rows, self._scale = rows, None
        checkpoint_fp8 = (quant_config is not None and quant_config.name == "fp8"
                          and getattr(quant_config, "checkpoint", False)
                          and isinstance(quant_config.get_linear_method(self, prefix), Fp8LinearMethod))
        if checkpoint_fp8:
            self._fp8_block = quant_config.block
            name = "weight_scale_inv" if quant_config.block else "weight_scale"
            setattr(self, name, set_weight_loader(nn.Parameter(torch.empty(0), requires_grad=False),
                                                  lambda p, w, shard_id=None: setattr(self, "_scale", w.float())))
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv_t", None, persistent=False)

    def _scaled(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's rows [R, K] of float8 values times their checkpoint scale."""
        s = self._scale
        if s is None:
            raise ValueError(f"{self.prefix}: float8 weights without their scale in the checkpoint")
        if self._fp8_block is not None:  # [ceil(N / bn), K / bk] blocks over all heads' rows
            bn, bk = self._fp8_block
            s = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            s = s[self._rows.start:self._rows.start + self._rows.size, :w.shape[1]]
        elif s.numel() > 1:  # per row
            s = s.reshape(-1, 1)[self._rows.start:self._rows.start + self._rows.size]
        return (w.float() * s).to(w.dtype)

    def process_weights_after_loading(self) -> None:
        if self.w_uk is not None:
            return
        if hasattr(self, "weight_scale_inv") or hasattr(self, "weight_scale"):
            self.weight.data = self._scaled(self.weight.data)
        w = self.weight.detach().view(self.num_heads, self.nope + self.v, -1)
        self.w_uk = w[:, :self.nope].contiguous()
        self.w_uv_t = w[:, self.nope:].transpose(1, 2).contiguous()
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)  # the two halves replace it


class MultiHeadLatentAttention(DirectCall, nn.Module):
    """DeepSeek's MLA with the latent cached (module docstring). x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: Any, layer_idx: int, spec: AttentionSpec, dtype: torch.dtype, quant_config: Any,
                 prefix: str) -> None:
        super().__init__()
        tp = get_tp()
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        h = divide(heads, tp.world_size, f"{prefix}: num_attention_heads")  # this rank's heads
        first = tp.rank * h
        self.num_heads, self.nope, self.rope_dim = h, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.rank, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        qk = self.nope + self.rope_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        q_rank = getattr(cfg, "q_lora_rank", None)

        def head_rows(inputs: int, name: str) -> Any:  # the query projection: this rank's heads' rows
            if not tp.is_parallel:
                return make_linear(inputs, h * qk, bias=False, dtype=dtype, quant_config=quant_config,
                                   prefix=f"{prefix}.{name}")
            return column_parallel_linear(inputs, (Slice(first * qk, h * qk, heads * qk),), bias=False, dtype=dtype,
                                          quant_config=quant_config, prefix=f"{prefix}.{name}")

        if q_rank:
            self.q_a_proj = make_linear(hidden, q_rank, bias=bias, dtype=dtype, quant_config=quant_config,
                                        prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(q_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = head_rows(q_rank, "q_b_proj")
        else:
            self.q_proj = head_rows(hidden, "q_proj")
        self.kv_a_proj_with_mqa = make_linear(hidden, self.rank + self.rope_dim, bias=bias, dtype=dtype,
                                              quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(self.rank, h, self.nope, self.v_dim, dtype, first_head=first,
                                            quant_config=quant_config, prefix=f"{prefix}.kv_b_proj")
        if tp.is_parallel:  # this rank's heads' input columns; the partial sums all-reduced
            self.o_proj = row_parallel_linear(Slice(first * self.v_dim, h * self.v_dim, heads * self.v_dim), hidden,
                                              bias=bias, dtype=dtype, quant_config=quant_config,
                                              prefix=f"{prefix}.o_proj")
        else:
            self.o_proj = make_linear(h * self.v_dim, hidden, bias=bias, dtype=dtype, quant_config=quant_config,
                                      prefix=f"{prefix}.o_proj")
        self.attn = Attention(h, self.rank + self.rope_dim, yarn_softmax_scale(cfg, qk), 1, layer_idx=layer_idx,
                              spec=spec)

    def forward(self, x: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        t, h, r = x.shape[0], self.num_heads, self.rank
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, self.nope + self.rope_dim)
        latent = self.kv_a_proj_with_mqa(x)  # [T, r + rope]: c, then k_pe
        c = self.kv_a_layernorm(latent[:, :r].contiguous())
        # The rotary parts as one [T, (H + 1) * rope] buffer: H query heads, then the shared key head.
        pe = torch.cat([q[:, :, self.nope:].reshape(t, h * self.rope_dim), latent[:, r:]], dim=1)
        q_pe, k_pe = rope.rotate_qk(pe, h, 1)
        q_lat = torch.bmm(q[:, :, :self.nope].transpose(0, 1), self.kv_b_proj.w_uk)  # [H, T, r]
        query = torch.cat([q_lat.transpose(0, 1), q_pe.reshape(t, h, self.rope_dim)], dim=-1).reshape(t, -1)
        key = torch.cat([c, k_pe], dim=-1)  # [T, r + rope]
        value = torch.cat([c, c.new_zeros(t, self.rope_dim)], dim=-1)  # apart from key: fp8 caches turn keys
        out = self.attn(query, key, value).view(t, h, r + self.rope_dim)[:, :, :r]  # [T, H, r]
        o = torch.bmm(out.transpose(0, 1), self.kv_b_proj.w_uv_t)  # [H, T, v]
        return self.o_proj(o.transpose(0, 1).reshape(t, h * self.v_dim))


class DeepseekRouter(nn.Module):
    """``mlp.gate``: logits in float32 (weight [E, hidden]) and, for V3's rule, ``e_score_correction_bias`` [E]."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> router logits [T, E] float32."""
        return F.linear(x.float(), self.weight)


class DeepseekMoE(DirectCall, nn.Module):
    """Router + fused routed experts + ungated shared experts. x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: Any, rule: RoutingRule, correction_bias: bool, dtype: torch.dtype, quant_config: Any,
                 prefix: str) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        self.gate = DeepseekRouter(cfg.hidden_size, rule.num_experts, correction_bias)
        self.experts = FusedMoE(rule, cfg.hidden_size, cfg.moe_intermediate_size, act, dtype=dtype,
                                quant_config=quant_config, prefix=f"{prefix}.experts")
        shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * shared, act, dtype=dtype,
                                       quant_config=quant_config, prefix=f"{prefix}.shared_experts") if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x), correction_bias=self.gate.e_score_correction_bias)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def sigmoid_routing_rule(cfg: Any, arch: str) -> RoutingRule:
    """DeepSeek-V3's router (``noaux_tc``: sigmoid scores, a correction bias, groups), as GLM-4.5 uses it too."""
    method = getattr(cfg, "topk_method", None) or "noaux_tc"
    scoring = getattr(cfg, "scoring_func", None) or "sigmoid"
    if method != "noaux_tc" or scoring != "sigmoid":
        raise ValueError(f"{arch}: routing topk_method={method!r} scoring_func={scoring!r} is not supported "
                         "(noaux_tc with sigmoid)")
    return RoutingRule(cfg.n_routed_experts, cfg.num_experts_per_tok, "sigmoid_topk",
                       renormalize=bool(cfg.norm_topk_prob), num_groups=int(cfg.n_group or 1),
                       topk_groups=int(cfg.topk_group or 1),
                       scaling=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0))


def sparse_layer(cfg: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` routes experts: ``mlp_layer_types`` ("dense" / "sparse") where the config lists
    them (GLM-4.7-Flash), else from ``first_k_dense_replace`` and ``moe_layer_freq``."""
    kinds = getattr(cfg, "mlp_layer_types", None)
    if kinds:
        return kinds[layer_idx] == "sparse"
    freq = int(getattr(cfg, "moe_layer_freq", 1) or 1)
    first_sparse = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    return bool(cfg.n_routed_experts) and layer_idx >= first_sparse and layer_idx % freq == 0


def dense_or_moe(cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str,
                 routing: Callable[[], tuple[RoutingRule, bool]]) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward block in DeepSeek's arrangement (its V2 / V3 and the families that took
    it: GLM-4.5, dots.llm1): a dense MLP, or a ``DeepseekMoE`` routed by ``routing()`` -> (rule, whether the
    router has a score correction bias)."""
    if not sparse_layer(cfg, layer_idx):
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"), dtype=dtype,
                        quant_config=quant_config, prefix=prefix)
    rule, correction_bias = routing()
    return DeepseekMoE(cfg, rule, correction_bias, dtype, quant_config, prefix)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as their bytes (torch indexes those), others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rope_rows_order(rope_dim: int) -> torch.Tensor:
    """The interleaved pairs' dims as rotate-half wants them: evens, then odds."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5: MLA; softmax routing, greedy or ``group_limited_greedy``, scaled by
    ``routed_scaling_factor`` (``norm_topk_prob`` is not applied, as in transformers); shared experts."""

    weight_mapping = WeightMapping(stacked=_GATE_UP, experts=STACKED_EXPERTS, skip=("rotary_emb.inv_freq",))

    @classmethod
    def rope_interleaved(cls, cfg: Any) -> bool:
        return True

    @classmethod
    def routing_rule(cls, cfg: Any) -> tuple[RoutingRule, bool]:
        """(the rule, whether the router has a score correction bias)."""
        method = getattr(cfg, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"{cls.__name__}: topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        return RoutingRule(cfg.n_routed_experts, cfg.num_experts_per_tok, "softmax_topk", renormalize=False,
                           num_groups=int(cfg.n_group or 1) if grouped else 1,
                           topk_groups=int(cfg.topk_group or 1) if grouped else 1,
                           scaling=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)), False

    @classmethod
    def make_attention(cls, cfg: Any, layer_idx: int, spec: AttentionSpec, dtype: torch.dtype, quant_config: Any,
                       prefix: str) -> nn.Module:
        return MultiHeadLatentAttention(cfg, layer_idx, spec, dtype, quant_config, prefix)

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        return dense_or_moe(cfg, layer_idx, dtype, quant_config, prefix, lambda: cls.routing_rule(cfg))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._deepseek_names(weights))

    def _deepseek_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint as our layers read it: multi-token-prediction layers (past ``num_hidden_layers``) left out,
        and the rows that give q_pe / k_pe reordered where DeepSeek interleaves its rotary pairs."""
        cfg = self.config
        num_layers = cfg.num_hidden_layers
        interleaved = self.rope_interleaved(cfg)
        nope, rope_dim, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        order = _rope_rows_order(rope_dim)
        for name, tensor in weights:
            if beyond_the_decoder(name, num_layers):
                continue
            # Weights (and a bias) only: an fp8 checkpoint's scales cover blocks the reordering stays inside.
            if interleaved and name.endswith((".q_proj.weight", ".q_b_proj.weight")):
                raw = _as_bytes(tensor)
                rows = raw.view(cfg.num_attention_heads, nope + rope_dim, -1)
                tensor = torch.cat([rows[:, :nope], rows[:, nope:][:, order]], dim=1).reshape(raw.shape).view(
                    tensor.dtype)
            elif interleaved and name.endswith((".kv_a_proj_with_mqa.weight", ".kv_a_proj_with_mqa.bias")):
                raw = _as_bytes(tensor)
                tensor = torch.cat([raw[:rank], raw[rank:][order]]).view(tensor.dtype)
            yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1, Kimi K2, Moonlight: MLA; sigmoid routing with a score correction bias and group limits
    (``noaux_tc``), renormalised with ``norm_topk_prob``, scaled by ``routed_scaling_factor``; shared experts."""

    @classmethod
    def rope_interleaved(cls, cfg: Any) -> bool:
        return bool(getattr(cfg, "rope_interleave", True))

    @classmethod
    def routing_rule(cls, cfg: Any) -> tuple[RoutingRule, bool]:
        return sigmoid_routing_rule(cfg, cls.__name__), True


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's architecture (latent attention, sigmoid routing with score correction, shared
    experts); each layer dense or sparse as ``mlp_layer_types`` says."""
