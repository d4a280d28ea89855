"""Fixtures of the audio tests (helpers in ``tests/helpers/whisper_fakes.py``)."""

from __future__ import annotations

import pytest

from helpers.whisper_fakes import spoken_wav, whisper_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return whisper_tokenizer()


@pytest.fixture(scope="session")
def speech_wav() -> bytes:
    return spoken_wav()
