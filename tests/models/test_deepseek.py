"""DeepSeek-V2 and V3 (multi-head latent attention with the latent cached; DeepSeek's routers) against transformers
on tiny random models built from transformers' own configs: whole prompts, chunked prefill + paged decodes, greedy
tokens through the engine; the routers' rules on their own; the cache holds one latent head per token."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.fused_moe import RoutingRule, select_experts
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.model_helpers import (
    chunked_prefill_and_decodes,
    engine_greedy_equals_hf,
    hf_logits,
    prefill_logits,
    random_ids,
)
from helpers.moe_configs import DEEPSEEK_VARIANTS, save_tiny_deepseek

ATOL = 2e-4

@pytest.fixture(scope="module", params=list(DEEPSEEK_VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path, hf = save_tiny_deepseek(request.param, tmp_path_factory.mktemp(request.param))
    model = load_model(resolve_model_config(ModelConfig(model=path, dtype="float32")), torch.device("cpu"))
    return request.param, path, hf, model


def test_prefill_matches_transformers(tiny) -> None:
    _, _, hf, model = tiny
    ids = random_ids(40, seed=1)
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    _, _, hf, model = tiny
    a, b = random_ids(30, seed=2), random_ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, hf_logits(hf, b), atol=ATOL, rtol=0)


def test_the_cache_holds_one_latent_head_per_token(tiny) -> None:
    from pagedllm.model_executor.layers.attention import attention_layers

    _, _, hf, model = tiny
    layers = attention_layers(model)
    cfg = hf.config
    assert len(layers) == cfg.num_hidden_layers
    assert {(a.num_heads, a.num_kv_heads, a.head_size) for a in layers} == {
        (cfg.num_attention_heads, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}


def test_greedy_tokens_through_the_engine_equal_transformers(tiny) -> None:
    variant, path, hf, _ = tiny
    engine_greedy_equals_hf(path, hf, [[1, *range(10, 30)], [1, 7, 99, 3, 42, 8], [1, *range(200, 170, -3)]])


def test_sigmoid_routing_with_groups_equals_transformers_router() -> None:
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tf.DeepseekV3Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.rand(16, generator=g))
    x = torch.randn(9, 16, generator=g)
    logits, want_w, want_ids = router(x)
    rule = RoutingRule(16, 4, "sigmoid_topk", renormalize=True, num_groups=4, topk_groups=2, scaling=2.5)
    weights, ids = select_experts(logits, rule, router.e_score_correction_bias)
    order, want_order = ids.sort(-1).indices, want_ids.sort(-1).indices  # transformers leaves top-k unsorted
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order))
    # the chosen experts lie in 2 groups of 4 per token
    assert all(len(set((ids[t] // 4).tolist())) <= 2 for t in range(9))


def test_group_limited_softmax_routing_equals_transformers_router() -> None:
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = tf.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=12, num_experts_per_tok=3,
                              n_group=3, topk_group=1, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(12, 16, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
    logits, want_w, want_ids = router(x)
    rule = RoutingRule(12, 3, "softmax_topk", num_groups=3, topk_groups=1, scaling=1.5)
    weights, ids = select_experts(logits, rule)
    order, want_order = ids.sort(-1).indices, want_ids.sort(-1).indices
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order))
    assert all(len(set((ids[t] // 4).tolist())) == 1 for t in range(7))  # one group of 4 per token


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_groups=3), "n_group"), (dict(num_groups=4, topk_groups=5), "topk_group"),
    (dict(num_groups=4, topk_groups=1, top_k=3), "exceeds"), (dict(scoring="topk_softmax", num_groups=2), "n_group")])
def test_bad_grouped_rules_are_refused_naming_the_setting(kwargs: dict, match: str) -> None:
    args = {"num_experts": 8, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        RoutingRule(**args)


def test_multi_token_prediction_layers_are_skipped(tmp_path) -> None:
    """A V3 checkpoint's MTP module (``model.layers.{num_hidden_layers}.*``) is not part of the decoder: left out."""
    from safetensors.torch import load_file, save_file

    path, hf = save_tiny_deepseek("v3", tmp_path / "m")
    tensors = load_file(f"{path}/model.safetensors")
    n = hf.config.num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 28, 24)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    model = load_model(resolve_model_config(ModelConfig(model=path, dtype="float32")))
    ids = random_ids(12, seed=4)
    torch.testing.assert_close(prefill_logits(model, ids), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_fp8_block_checkpoint_equals_its_dequantized_model(tmp_path) -> None:
    """DeepSeek-V3's release format: every projection float8 with 16 x 16 ``weight_scale_inv`` blocks (kv_b_proj
    scaled back to float at load, the experts kept fp8 and stacked, the dense projections fp8 panels), router and
    norms float; logits equal the dequantized float model's."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from helpers.fp8_checkpoints import fp8_checkpoint

    src, _ = save_tiny_deepseek("v3-fp8-dims", tmp_path / "float")
    names = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dequantized = fp8_checkpoint(Path(src), tmp_path / "fp8", "block", linear_names=names)
    assert any(n.endswith("kv_b_proj.weight") for n in dequantized)
    float_dir = tmp_path / "dequantized"
    shutil.copytree(src, float_dir)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(float_dir / "model.safetensors"),
              metadata={"format": "pt"})
    model = load_model(resolve_model_config(ModelConfig(model=str(tmp_path / "fp8"), dtype="float32")))
    ref = load_model(resolve_model_config(ModelConfig(model=str(float_dir), dtype="float32")))
    ids = random_ids(30, seed=5)
    torch.testing.assert_close(prefill_logits(model, ids), prefill_logits(ref, ids), atol=2e-4, rtol=1e-4)


def test_the_correction_bias_and_the_latent_change_the_output(tiny) -> None:
    """The inputs these paths add are read: zeroing V3's score-correction bias changes the routing and so the
    logits; perturbing kv_b_proj (the latent's up-projection) changes them too."""
    from pagedllm.model_executor.models.deepseek import DeepseekRouter, LatentUpProjection

    variant, _, _, model = tiny
    ids = random_ids(24, seed=9)
    before = prefill_logits(model, ids)
    routers = [m for m in model.modules() if isinstance(m, DeepseekRouter) and m.e_score_correction_bias is not None]
    latents = [m for m in model.modules() if isinstance(m, LatentUpProjection)]
    saved = [(r.e_score_correction_bias.clone(), None) for r in routers] + [(m.w_uk.clone(), m) for m in latents]
    try:
        for r in routers:
            r.e_score_correction_bias.zero_()
        if routers:
            assert not torch.allclose(prefill_logits(model, ids), before, atol=1e-3), variant
            for r, (bias, _) in zip(routers, saved, strict=False):
                r.e_score_correction_bias.copy_(bias)
        latents[0].w_uk.mul_(1.5)
        assert not torch.allclose(prefill_logits(model, ids), before, atol=1e-3), variant
    finally:
        for r, (bias, _) in zip(routers, saved, strict=False):
            r.e_score_correction_bias.copy_(bias)
        latents[0].w_uk.copy_(saved[len(routers)][0])
