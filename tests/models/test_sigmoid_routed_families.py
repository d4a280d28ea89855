"""MiniMax-M2 and dots.llm1 against transformers on tiny random models: MiniMax-M2's q/k norms over all heads with
partial rotary (rows and norm weights reordered at load) and Mixtral-named experts on disk; dots.llm1's Qwen3
attention with a sliding layer over DeepSeek-V3's grouped router and shared expert; both route by sigmoid scores
with a correction bias. Whole prompts, chunked prefill + paged decodes, greedy tokens through the engine."""

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
from helpers.moe_configs import save_tiny_dots1, save_tiny_minimax_m2

ATOL = 2e-4
FAMILIES = {"minimax_m2": (save_tiny_minimax_m2, "MiniMaxM2ForCausalLM"),
            "dots1": (save_tiny_dots1, "Dots1ForCausalLM")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    save, arch = FAMILIES[request.param]
    path, hf = save(tmp_path_factory.mktemp(request.param))
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32"))
    assert mc.architecture == arch
    return request.param, path, hf, load_model(mc, torch.device("cpu"))


def test_minimax_checkpoints_keep_their_own_names(tmp_path) -> None:
    from safetensors import safe_open

    path, _ = save_tiny_minimax_m2(tmp_path / "m")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in names


def test_prefill_matches_transformers(tiny) -> None:
    _, _, hf, model = tiny
    ids = random_ids(40, seed=1)  # past the sliding layer's window of 16
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    _, _, hf, model = tiny
    a, b = random_ids(30, seed=2), random_ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, hf_logits(hf, b), atol=ATOL, rtol=0)


def test_greedy_tokens_through_the_engine_equal_transformers(tiny) -> None:
    _, path, hf, _ = tiny
    engine_greedy_equals_hf(path, hf, [[1, *range(10, 30)], [1, 7, 99, 3, 42, 8]])
