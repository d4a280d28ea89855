"""The GPU KV-cache profiling step (worker/profile_step.py), checked on the CPU: its shape covers the whole
token budget even when max_model_len is shorter, it runs the model and the sampler's costliest stages, and it
leaves no KV cache bound behind."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.attention import attention_layers
from pagedllm.model_executor.loader import load_model
from pagedllm.sample.batch_state import build_sampling_metadata
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.profile_step import profile_query_lens, run_profile_step, worst_case_sampling_params

from helpers.model_helpers import make_tiny_llama


@pytest.mark.parametrize("budget,max_len,max_seqs,expected", [
    (2048, 8192, 256, [2048]),
    (8192, 2048, 256, [2048] * 4),  # one prompt of max_model_len would profile a quarter of the step
    (5000, 2048, 256, [2048, 2048, 904]),
    (10, 3, 2, [3, 3]),  # never more prompts than max_num_seqs
    (7, 3, 8, [1, 3, 3]),  # a one-token prompt is a decode: it goes first
    (16, 0, 4, [16]),  # max_model_len not known yet: one prompt of the budget
])
def test_query_lens_cover_the_token_budget(budget: int, max_len: int, max_seqs: int, expected: list[int]) -> None:
    assert profile_query_lens(budget, max_len, max_seqs) == expected


def test_worst_case_params_turn_on_every_big_stage() -> None:
    rows = 3
    meta = build_sampling_metadata([worst_case_sampling_params()] * rows, [[0]] * rows, [[0]] * rows, [None] * rows,
                                   [2], 256, torch.device("cpu"))
    steps = meta.steps
    assert steps["top_k_top_p"].top_p_without_top_k and steps["top_k_top_p"].top_k is None  # full-vocabulary sort
    assert "penalties" in steps and steps["penalties"].prompt_token_ids is not None
    assert "min_p" in steps and meta.max_num_logprobs is not None and meta.max_num_logprobs > 0


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = make_tiny_llama(tmp_path_factory.mktemp("profile_llama"))
    model = load_model(ModelConfig(model=path, dtype="float32"), "cpu")
    return ModelRunner(model, torch.device("cpu"), torch.float32, 4, 256, [2])


def test_profile_step_runs_model_and_sampler_and_releases_the_cache(runner: ModelRunner, monkeypatch) -> None:
    seen = {}
    forward, sample = runner.model.forward, runner.sampler.forward

    def spy_forward(input_ids, positions):
        seen["positions"] = positions.tolist()
        seen["bound"] = all(layer.kv_cache is not None for layer in attention_layers(runner.model))
        return forward(input_ids, positions)

    def spy_sample(logits, meta):
        seen["rows"] = logits.shape[0]
        return sample(logits, meta)

    monkeypatch.setattr(runner.model, "forward", spy_forward)
    monkeypatch.setattr(runner.sampler, "forward", spy_sample)
    query_lens = profile_query_lens(20, 8, 3)
    assert query_lens == [8, 8, 4]
    run_profile_step(runner, query_lens, block_size=4, max_sampling_rows=2)
    assert seen["bound"]
    assert seen["positions"] == list(range(8)) * 2 + list(range(4))  # three fresh prompts
    assert seen["rows"] == 2
    assert runner.kv_caches == []
    assert all(layer.kv_cache is None for layer in attention_layers(runner.model))


def test_release_drops_the_draft_models_cache_too(runner: ModelRunner) -> None:
    runner.draft_model = runner.model  # a draft model of the same shape (its layers are the target's here)
    try:
        runner.init_kv_cache(6)
        assert len(runner.draft_kv_caches) == 2
        runner.release_kv_cache()
        assert runner.draft_kv_caches == [] and runner.kv_caches == []
        assert all(layer.kv_cache is None for layer in attention_layers(runner.model))
    finally:
        runner.draft_model = None
