"""Log-mel features of one 30 s window, as transformers' ``WhisperFeatureExtractor`` makes them."""

from __future__ import annotations

import functools

import numpy as np

from pagedllm.audio.decode import SAMPLE_RATE

WINDOW_S = 30  # Whisper's encoder always reads 30 s (3000 frames of 10 ms)
NUM_FRAMES = 3000


@functools.lru_cache(maxsize=4)
def _extractor(n_mels: int):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=n_mels, sampling_rate=SAMPLE_RATE)


def log_mel(samples: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """float32 ``[n_mels, 3000]`` for up to 30 s of 16 kHz samples ``[n]`` (zero-padded to 30 s, as Whisper)."""
    if samples.size > WINDOW_S * SAMPLE_RATE:
        raise ValueError(f"log_mel: a window holds at most {WINDOW_S} s, got {samples.size / SAMPLE_RATE:.2f} s")
    feats = _extractor(n_mels)(samples, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    return np.ascontiguousarray(feats, dtype=np.float32)
