
import pytest

from helpers.whisper_helpers import make_tiny_whisper, speech_features


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Whisper HF folder (tiny.en's tokenizer and decoding ids, 1500 encoder positions)."""
    return make_tiny_whisper(tmp_path_factory.mktemp("tiny_whisper"))


@pytest.fixture(scope="session")
def clip_features(tmp_path_factory: pytest.TempPathFactory):
    """80-mel features [80, 3000] of a short espeak-ng sentence; skips without espeak-ng."""
    return speech_features(tmp_path_factory.mktemp("clip"))
