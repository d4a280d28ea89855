"""Real Whisper models (CTranslate2 packages) on real speech (espeak-ng): greedy transcripts, with and without
timestamps, equal transformers' generate on the same weights."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

from helpers.whisper_helpers import decoder_prompt, reference_generate, reference_model

pytestmark = pytest.mark.slow


def _transcribe(llm: LLM, features, timestamps: bool = False, max_tokens: int = 120) -> list[int]:
    prompt = decoder_prompt(llm.get_tokenizer(), llm.engine.config.model, timestamps)
    out = llm.generate({"prompt_token_ids": prompt, "audio_features": features},
                       SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_tiny_en_transcripts_equal_transformers(clip_features) -> None:
    llm = LLM(model="whisper-tiny.en", dtype="float32", kv_cache_memory="256MiB")
    mc = llm.engine.config.model
    ref = reference_model(mc)
    eos = mc.hf_config.eos_token_id
    tokens = _transcribe(llm, clip_features)
    assert tokens[-1] == eos and tokens[:-1] == reference_generate(ref, mc, clip_features)
    text = llm.get_tokenizer().decode(tokens, skip_special_tokens=True).lower()
    assert "report" in text and "friday" in text, text
    with_ts = _transcribe(llm, clip_features, timestamps=True)
    assert with_ts == reference_generate(ref, mc, clip_features, timestamps=True, max_new_tokens=120)
    ts_begin = mc.hf_config.no_timestamps_token_id + 1
    assert with_ts[0] == ts_begin and sum(t >= ts_begin for t in with_ts) >= 2  # <|0.00|> ... <|x.xx|>
    decoded = llm.get_tokenizer().decode(with_ts, decode_with_timestamps=True)
    assert decoded.startswith("<|0.00|>"), decoded


def test_base_transcript_equals_transformers(clip_features) -> None:
    llm = LLM(model="whisper-base", dtype="float32", kv_cache_memory="256MiB")
    mc = llm.engine.config.model
    assert mc.hf_config.is_multilingual and mc.vocab_size == 51865
    tokens = _transcribe(llm, clip_features)
    assert tokens[:-1] == reference_generate(reference_model(mc), mc, clip_features)
    assert "report" in llm.get_tokenizer().decode(tokens, skip_special_tokens=True).lower()
