"""MiniMax-M2 and dots.llm1 against transformers on tiny random models: MiniMax-M2's q/k norms over all heads with
partial rotary (rows and norm weights reordered at load) and Mixtral-named experts on disk; dots.llm1's Qwen3
attention with a sliding layer over DeepSeek-V3's grouped router and shared expert; both route by sigmoid scores
with a correction bias. Whole prompts, chunked prefill + paged decodes, greedy tokens through the engine."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.model_helpers import chunked_prefill_and_decodes, prefill_logits
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


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_minimax_checkpoints_keep_their_own_names(tmp_path) -> None:
    from safetensors import safe_open

    path, _ = save_tiny_minimax_m2(tmp_path / "m")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in names


def test_prefill_matches_transformers(tiny) -> None:
    _, _, hf, model = tiny
    ids = _ids(40, seed=1)  # past the sliding layer's window of 16
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    _, _, hf, model = tiny
    a, b = _ids(30, seed=2), _ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, _hf_logits(hf, b), atol=ATOL, rtol=0)


def test_greedy_tokens_through_the_engine_equal_transformers(tiny) -> None:
    from pagedllm import LLM, SamplingParams

    _, path, hf, _ = tiny
    prompts = [[1, *range(10, 30)], [1, 7, 99, 3, 42, 8]]
    llm = LLM(path, dtype="float32", kv_cache_dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()
