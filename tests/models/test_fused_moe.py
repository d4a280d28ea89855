"""The fused MoE layer on its own: each routing rule equals transformers' arithmetic, the grouped experts (the C++
kernel's panels in float32, per-expert bf16 layers, torch's grouped matmul and the loop for odd sizes) equal the
plain per-expert loop, a decode token touches only its k experts, and the loader's checks name what is wrong."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule, select_experts
from pagedllm.model_executor.layers.fused_moe.grouping import group_by_expert
from pagedllm.model_executor.layers.fused_moe.reference import reference_moe

from helpers.moe_configs import bf16_experts_form


def _weights(rule: RoutingRule, hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float32 stacks: gate_up [E, 2I, H], down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rule.num_experts, 2 * inter, hidden, generator=g) * 0.1,
            torch.randn(rule.num_experts, hidden, inter, generator=g) * 0.1)


def _layer(rule: RoutingRule, gate_up: torch.Tensor, down: torch.Tensor,
           dtype: torch.dtype = torch.float32) -> FusedMoE:
    """A loaded layer holding ``gate_up``, ``down`` (fused checkpoint tensors), its weights bound for the platform."""
    layer = FusedMoE(rule, down.shape[1], down.shape[2], dtype=dtype, prefix="model.layers.0.mlp.experts")
    layer.gate_up_proj.weight_loader(layer.gate_up_proj, gate_up.to(dtype), None)
    layer.down_proj.weight_loader(layer.down_proj, down.to(dtype), None)
    layer.process_weights_after_loading()
    return layer


def test_softmax_topk_renormalised_is_mixtral_rule() -> None:
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(logits, RoutingRule(8, 2, "softmax_topk", renormalize=True))
    probs = torch.softmax(logits, -1)
    want_w, want_ids = torch.topk(probs, 2, -1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w / want_w.sum(-1, keepdim=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))


def test_softmax_topk_without_renormalisation_keeps_probabilities() -> None:
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    weights, _ = select_experts(logits, RoutingRule(16, 4, "softmax_topk", renormalize=False))
    torch.testing.assert_close(weights, torch.topk(torch.softmax(logits, -1), 4, -1).values)
    assert (weights.sum(-1) < 1).all()


def test_topk_softmax_normalises_over_the_chosen_only() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(logits, RoutingRule(8, 3, "topk_softmax"))
    top, want_ids = torch.topk(logits, 3, -1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, torch.softmax(top, -1))


def test_routing_rule_refuses_unknown_scoring_and_bad_top_k() -> None:
    with pytest.raises(ValueError, match="sigmoid"):
        RoutingRule(8, 2, "sigmoid")
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\)"):
        RoutingRule(8, 9)


def test_grouping_sorts_rows_by_expert_stably() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    groups = group_by_expert(weights, ids, num_experts=4)
    assert groups.ends.tolist() == [2, 4, 6, 6]
    assert groups.token_of.tolist() == [0, 1, 1, 2, 0, 2]
    assert groups.weight.flatten().tolist() == pytest.approx([0.4, 0.7, 0.3, 0.1, 0.6, 0.9])


def test_grouped_matmul_path_equals_the_per_expert_loop() -> None:
    """The portable form (no C++ kernels: CUDA, no compiler): torch's grouped matmul, and the loop for odd sizes."""
    from pagedllm.model_executor.layers.fused_moe.layer import grouped_matmul

    weights = torch.randn(5, 24, 32)
    counts = [3, 0, 6, 1, 0]
    rows = torch.randn(sum(counts), 32)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    want = torch.cat([rows[e - c:e] @ weights[i].T for i, (c, e) in enumerate(zip(counts, ends.tolist(),
                                                                                    strict=True))])
    torch.testing.assert_close(grouped_matmul(rows, weights, ends), want, atol=1e-5, rtol=1e-5)
    odd = torch.randn(5, 24, 30)
    want_odd = torch.cat([rows[e - c:e, :30] @ odd[i].T for i, (c, e) in enumerate(zip(counts, ends.tolist(),
                                                                                        strict=True))])
    torch.testing.assert_close(grouped_matmul(rows[:, :30].contiguous(), odd, ends), want_odd, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rule,hidden,inter", [
    (RoutingRule(4, 2, "softmax_topk", renormalize=True), 64, 32),
    (RoutingRule(16, 1, "softmax_topk", renormalize=True), 64, 48),
    (RoutingRule(8, 4, "softmax_topk"), 32, 16),
    (RoutingRule(8, 3, "topk_softmax"), 64, 32),
    (RoutingRule(6, 2, "softmax_topk"), 30, 10),  # rows not 16-byte multiples: the loop fallback
])
def test_grouped_experts_equal_the_per_expert_loop(rule: RoutingRule, hidden: int, inter: int) -> None:
    gate_up, down = _weights(rule, hidden, inter)
    layer = _layer(rule, gate_up, down)
    assert layer.describe() == "float32 panels (moe_packed_gemm)"  # the C++ kernel (tests build the kernels)
    x = torch.randn(37, hidden)
    logits = torch.randn(37, rule.num_experts)
    want = reference_moe(x, logits, gate_up, down, rule)
    torch.testing.assert_close(layer(x, logits), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x[:1], logits[:1]), want[:1], atol=1e-5, rtol=1e-5)  # one decode token


def test_bfloat16_experts_close_to_float32() -> None:
    rule = RoutingRule(8, 2, "softmax_topk", renormalize=True)
    gate_up, down = _weights(rule, 64, 32)
    x, logits = torch.randn(20, 64), torch.randn(20, 8)
    want = reference_moe(x, logits, gate_up, down, rule)
    bf16 = _layer(rule, gate_up, down, dtype=torch.bfloat16)
    assert "bfloat16" in bf16.describe() and bf16.describe().endswith(bf16_experts_form())
    got = bf16(x.bfloat16(), logits)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.03, rtol=0.05)


def test_a_token_reads_only_its_experts() -> None:
    """Poisoning the experts a token did not choose leaves its output unchanged."""
    rule = RoutingRule(8, 2, "softmax_topk", renormalize=True)
    gate_up, down = _weights(rule, 64, 32)
    x, logits = torch.randn(1, 64), torch.randn(1, 8)
    want = _layer(rule, gate_up, down)(x, logits)
    chosen = set(select_experts(logits, rule)[1].flatten().tolist())
    for e in set(range(8)) - chosen:
        gate_up[e].fill_(float("nan"))
        down[e].fill_(float("nan"))
    torch.testing.assert_close(_layer(rule, gate_up, down)(x, logits), want)


def test_loader_takes_per_expert_and_fused_tensors_and_names_bad_shapes() -> None:
    rule = RoutingRule(4, 2)
    gate_up, down = torch.randn(4, 64, 16), torch.randn(4, 16, 32)
    per_expert = FusedMoE(rule, 16, 32, dtype=torch.float32, prefix="m.experts")
    for e in range(4):
        per_expert.gate_up_proj.weight_loader(per_expert.gate_up_proj, gate_up[e, :32], (e, 0))
        per_expert.gate_up_proj.weight_loader(per_expert.gate_up_proj, gate_up[e, 32:], (e, 1))
        per_expert.down_proj.weight_loader(per_expert.down_proj, down[e], (e, 0))
    fused = FusedMoE(rule, 16, 32, dtype=torch.float32, prefix="m.experts")
    fused.gate_up_proj.weight_loader(fused.gate_up_proj, gate_up, None)
    fused.down_proj.weight_loader(fused.down_proj, down, None)
    for layer in (per_expert, fused):
        assert torch.equal(layer.gate_up_proj, gate_up) and torch.equal(layer.down_proj, down)
    with pytest.raises(ValueError, match=r"m\.experts\.2\.down_proj: checkpoint \(16, 31\)"):
        fused.down_proj.weight_loader(fused.down_proj, torch.randn(16, 31), (2, 0))


@pytest.mark.parametrize("form", ["panels", "grouped", "bf16"])
def test_expert_biases_and_clamped_swiglu_equal_the_per_expert_loop(form: str) -> None:
    """gpt-oss's experts: biases on both projections (the down bias scaled by the router weight with the rest) and the
    clamped SwiGLU, in each weight form (panels: the C++ kernel; grouped: weights never bound, the portable form)."""
    from pagedllm.model_executor.layers.activation import ClampedSwiGLU

    rule = RoutingRule(8, 2, "topk_softmax")
    gate_up, down = _weights(rule, 64, 32)
    g = torch.Generator().manual_seed(3)
    gate_up_bias, down_bias = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)  # a low limit: both clamps bite on these activations
    dtype = torch.bfloat16 if form.startswith("bf16") else torch.float32
    layer = FusedMoE(rule, 64, 32, act, dtype=dtype, prefix="m.experts", bias=True)
    for param, tensor in ((layer.gate_up_proj, gate_up), (layer.down_proj, down),
                          (layer.gate_up_proj_bias, gate_up_bias), (layer.down_proj_bias, down_bias)):
        param.weight_loader(param, tensor.to(dtype), None)
    if form != "grouped":
        layer.process_weights_after_loading()
    assert {"panels": "panels", "grouped": "grouped_mm", "bf16": bf16_experts_form()}[form] in layer.describe()
    x, logits = torch.randn(29, 64), torch.randn(29, 8)
    want = reference_moe(x, logits, gate_up, down, rule, gate_up_bias, down_bias, act)
    without_bias = reference_moe(x, logits, gate_up, down, rule, act_and_mul=act)
    assert (want - without_bias).abs().max() > 0.1
    got = layer(x.to(dtype), logits).float()
    tol = dict(atol=0.05, rtol=0.05) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(layer(x[:1].to(dtype), logits[:1]).float(), want[:1], **tol)  # one decode token


def test_clamped_swiglu_is_transformers_gpt_oss_gate() -> None:
    """Our [gate | up] halves against transformers' interleaved columns (gate = even, up = odd)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssExperts

    from pagedllm.model_executor.layers.activation import ClampedSwiGLU

    hf = GptOssExperts(GptOssConfig(num_local_experts=1, hidden_size=8, intermediate_size=16, swiglu_limit=1.5))
    interleaved = torch.randn(5, 32, generator=torch.Generator().manual_seed(4)) * 3
    ours = torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1)
    torch.testing.assert_close(ClampedSwiGLU(1.702, 1.5)(ours), hf._apply_gate(interleaved))


def test_bf16_experts_routed_in_kernels_equal_the_torch_routing() -> None:
    """bf16 experts stacked for ``moe_bf16_gemm`` and routed by the C++ routing kernels (bf16 rows, float32 sums):
    the same output as the torch routing of the same layer, and close to the float32 reference."""
    rule = RoutingRule(8, 2, "softmax_topk", renormalize=True)
    gate_up, down = _weights(rule, 64, 32)
    layer = _layer(rule, gate_up, down, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(21, 64, generator=g).bfloat16()
    # distinct logits per token: bf16 rounds random logits into ties, whose order torch.topk leaves unspecified
    logits = torch.stack([torch.randperm(8, generator=g) for _ in range(21)]).float().div(2).bfloat16()
    if bf16_experts_form() != "stacked (moe_bf16_gemm)":
        pytest.skip("bf16 experts run per expert on a CPU without AVX-512 BF16")
    assert layer.routes_in_kernels(x, logits)
    in_kernels = layer(x, logits)
    layer._routes_in_kernels = False  # the torch routing of the same experts
    torch.testing.assert_close(in_kernels, layer(x, logits), atol=1e-2, rtol=1e-2)
    want = reference_moe(x.float(), logits.float(), gate_up, down, rule)
    torch.testing.assert_close(in_kernels.float(), want, atol=0.05, rtol=0.05)
