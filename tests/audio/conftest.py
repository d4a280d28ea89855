"""Fixtures of the audio tests (helpers in ``whisper_fakes.py``)."""

from __future__ import annotations

import pytest
from whisper_fakes import spoken_wav, whisper_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return whisper_tokenizer()


@pytest.fixture(scope="session")
def speech_wav() -> bytes:
    return spoken_wav()
