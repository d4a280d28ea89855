"""The transformers fallback on architectures pagedllm has no native code for (tiny random models): greedy outputs
through the engine (mixed-length batch, chunked prefill, paged KV cache) equal transformers' ``generate`` on each
prompt alone; a prefix-cache hit changes nothing; Llama forced through the fallback equals the native path."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.attention import attention_layers

from helpers.arch_configs import save_tiny
from helpers.fallback_configs import FALLBACK_ARCHS, save_fallback_tiny

PROMPT_LENS = (40, 7, 23)  # the first is chunked (32-token budget) and outgrows the sliding windows (16)
MAX_TOKENS = 10
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=32)


def _prompts() -> list[list[int]]:
    return [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in PROMPT_LENS]


def _hf_generate(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def _engine_model(llm: LLM):
    return llm.engine.core.worker.runner.model


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=MAX_TOKENS,
                                                                                    temperature=0), use_tqdm=False)


@pytest.fixture(scope="module", params=list(FALLBACK_ARCHS))
def fallback(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    path, hf = save_fallback_tiny(arch, tmp_path_factory.mktemp(arch))
    llm = LLM(model=path, **ENGINE)
    expected = [_hf_generate(hf, p) for p in _prompts()]
    yield arch, llm, expected
    llm.engine.core.close()


def test_mixed_batch_matches_transformers_generate(fallback) -> None:
    """One batch of three prompts of different lengths (one chunked) equals transformers on each prompt alone: each
    request attends to its own KV blocks only, so pagedllm's paged attention is what runs."""
    arch, llm, expected = fallback
    config = llm.engine.config.model
    assert (config.architecture, config.model_impl) == (arch, "transformers")
    layers = attention_layers(_engine_model(llm))
    assert layers and all(layer.kv_cache is not None for layer in layers)
    assert [o.outputs[0].token_ids for o in _generate(llm, _prompts())] == expected


def test_prefix_cache_hit_gives_the_same_output(fallback) -> None:
    _, llm, expected = fallback
    prompt = _prompts()[0]
    first = _generate(llm, [prompt])[0]
    again = _generate(llm, [prompt])[0]
    assert again.num_cached_tokens >= 32  # whole blocks of the 40-token prompt came from the cache
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[0]


def test_sliding_window_layers_come_from_the_model(tmp_path) -> None:
    """Gemma 2 alternates sliding and full layers: the probe gives the engine both kinds (two KV cache groups)."""
    path, _ = save_fallback_tiny("Gemma2ForCausalLM", tmp_path)
    llm = LLM(model=path, **ENGINE)
    try:
        specs = [layer.spec for layer in attention_layers(_engine_model(llm))]
        assert [s.kind for s in specs] == ["sliding", "causal"]
        assert llm.engine.config.cache.sliding_group() is not None
    finally:
        llm.engine.core.close()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))[0]


def test_llama_through_the_fallback_equals_native(llama_folder: str) -> None:
    prompts = _prompts()
    native = LLM(model=llama_folder, model_impl="pagedllm", **ENGINE)
    try:
        assert native.engine.config.model.model_impl == "pagedllm"
        expected = [o.outputs[0].token_ids for o in _generate(native, prompts)]
    finally:
        native.engine.core.close()
    forced = LLM(model=llama_folder, model_impl="transformers", **ENGINE)
    try:
        assert forced.engine.config.model.model_impl == "transformers"
        assert [o.outputs[0].token_ids for o in _generate(forced, prompts)] == expected
    finally:
        forced.engine.core.close()


def test_ngram_speculation_and_structured_outputs_through_the_fallback(llama_folder: str) -> None:
    """n-gram drafts verified by the fallback model keep greedy outputs; a grammar constrains its sampling."""
    from pagedllm.sampling_params import StructuredOutputsParams

    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    plain = LLM(model=llama_folder, model_impl="transformers", **ENGINE)
    try:
        expected = _generate(plain, [prompt])[0].outputs[0].token_ids
        choice = plain.generate([{"prompt_token_ids": prompt}], SamplingParams(
            max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(choice=["t7", "t9"])),
            use_tqdm=False)[0].outputs[0].text.strip()  # the word tokenizer detokenizes with a leading space
        assert choice in ("t7", "t9")
    finally:
        plain.engine.core.close()
    spec = LLM(model=llama_folder, model_impl="transformers", **ENGINE,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    try:
        assert _generate(spec, [prompt])[0].outputs[0].token_ids == expected
        assert spec.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    finally:
        spec.engine.core.close()


def test_a_fallback_model_as_the_draft(llama_folder: str, tmp_path) -> None:
    """A draft model without native code (OLMo 2, same vocabulary) drafts for a native target: outputs unchanged."""
    draft, _ = save_fallback_tiny("Olmo2ForCausalLM", tmp_path)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    native = LLM(model=llama_folder, **ENGINE)
    try:
        expected = _generate(native, [prompt])[0].outputs[0].token_ids
    finally:
        native.engine.core.close()
    spec = LLM(model=llama_folder, **ENGINE,
               speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    try:
        assert spec.engine.config.speculative.draft_model_config.model_impl == "transformers"
        assert _generate(spec, [prompt])[0].outputs[0].token_ids == expected
        assert spec.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    finally:
        spec.engine.core.close()
