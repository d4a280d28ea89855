"""GLM-4.5 MoE (``Glm4MoeForCausalLM``) against transformers on tiny random models: half of each head rotates
(partial rotary on the full-width kernels, q/k rows reordered at load), q/k/v bias, q/k norms or none, DeepSeek-V3's
router; whole prompts, chunked prefill + paged decodes and greedy tokens through the engine; the rotary table and
the reordering on their own."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.model_helpers import (
    chunked_prefill_and_decodes,
    engine_greedy_equals_hf,
    hf_logits,
    prefill_logits,
    random_ids,
)
from helpers.moe_configs import GLM4_MOE_VARIANTS, save_tiny_glm4_moe

ATOL = 2e-4


@pytest.fixture(scope="module", params=list(GLM4_MOE_VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path, hf = save_tiny_glm4_moe(request.param, tmp_path_factory.mktemp(request.param))
    model = load_model(resolve_model_config(ModelConfig(model=path, dtype="float32")), torch.device("cpu"))
    return path, hf, model


def test_prefill_matches_transformers(tiny) -> None:
    _, hf, model = tiny
    ids = random_ids(40, seed=1)
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    _, hf, model = tiny
    a, b = random_ids(30, seed=2), random_ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, hf_logits(hf, b), atol=ATOL, rtol=0)


def test_greedy_tokens_through_the_engine_equal_transformers(tiny) -> None:
    path, hf, _ = tiny
    engine_greedy_equals_hf(path, hf, [[1, *range(10, 30)], [1, 7, 99, 3, 42, 8]])


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 8), (128, 64), (64, 16), (80, 40)])
def test_partial_rotary_on_the_full_width_table_equals_transformers(head_dim: int, rotary_dim: int) -> None:
    """Reordered q and k rotated by the full-width table give transformers' partial-rotary scores exactly."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    from pagedllm.model_executor.layers.rotary_embedding import RopeStep, RotaryEmbedding, partial_rotary_order

    g = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([0, 3, 17, 90])
    q, k = torch.randn(4, 2, head_dim, generator=g), torch.randn(4, 1, head_dim, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = positions[:, None].double() * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None].double(), k.transpose(0, 1)[None].double(),
                                          emb.cos()[None], emb.sin()[None])  # [1, heads, T, D]
    rope = RotaryEmbedding(head_dim, 128, 10000.0, {}, torch.float64, rotary_dim=rotary_dim)
    order = partial_rotary_order(head_dim, rotary_dim)
    assert sorted(order.tolist()) == list(range(head_dim))
    qkv = torch.cat([q[:, :, order].reshape(4, -1), k[:, :, order].reshape(4, -1), torch.zeros(4, head_dim)], 1)
    got_q, got_k = RopeStep(rope, positions).rotate_qk(qkv.double(), 2, 1)
    # every query position against every key position (at equal positions rotary leaves q . k as it is)
    scores = torch.einsum("thd,skd->thsk", got_q.view(4, 2, head_dim), got_k.view(4, 1, head_dim))
    want = torch.einsum("htd,ksd->thsk", want_q[0], want_k[0])
    torch.testing.assert_close(scores, want)
    assert not torch.allclose(scores, torch.einsum("thd,skd->thsk", q.double(), k.double()))  # it did rotate


def test_partial_rotary_is_refused_where_a_family_does_not_reorder() -> None:
    import transformers as tf

    from pagedllm.model_executor.models.llama import LlamaForCausalLM

    cfg = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                         vocab_size=300)
    cfg.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match="LlamaForCausalLM: partial_rotary_factor"):
        LlamaForCausalLM(cfg)
