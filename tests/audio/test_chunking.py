"""The long-audio split: cuts at the quietest 100 ms of the last second before each 30 s mark, true offsets."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.audio.chunking import ENERGY_WINDOW, quietest_window_start, split_audio
from pagedllm.audio.decode import SAMPLE_RATE
from pagedllm.audio.features import NUM_FRAMES, log_mel

SR = SAMPLE_RATE


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * SR)) * 0.3).astype(np.float32)


def test_short_audio_is_one_chunk():
    audio = _noise(12.5)
    [chunk] = split_audio(audio)
    assert chunk.start_sample == 0 and chunk.samples.size == audio.size


def test_cuts_at_the_quiet_window_and_keeps_true_offsets():
    audio = _noise(75)
    quiet = [int(29.3 * SR), int(29.3 * SR) + int(29.6 * SR)]  # the second silence is 29.6 s after the first cut
    for q in quiet:
        audio[q:q + ENERGY_WINDOW] = 0.0
    chunks = split_audio(audio)
    assert [c.start_sample for c in chunks] == [0, quiet[0], quiet[1]]
    assert [c.start_s for c in chunks] == pytest.approx([0.0, 29.3, 58.9])  # not 0, 30, 60
    assert np.array_equal(np.concatenate([c.samples for c in chunks]), audio)  # nothing lost, nothing twice
    assert all(c.duration_s <= 30.0 for c in chunks)


def test_cut_is_in_the_last_second_when_all_is_loud():
    chunks = split_audio(_noise(95, seed=3))
    for prev, nxt in zip(chunks, chunks[1:]):
        assert 29.0 * SR <= nxt.start_sample - prev.start_sample <= 30.0 * SR
        assert (nxt.start_sample - prev.start_sample - 29 * SR) % ENERGY_WINDOW == 0  # on the 100 ms grid


def test_silence_before_the_search_window_is_ignored():
    audio = _noise(40)
    audio[int(20 * SR):int(21 * SR)] = 0.0  # quiet, but not in the last second before 30 s
    chunks = split_audio(audio)
    assert 29 * SR <= chunks[1].start_sample <= 30 * SR


def test_quietest_window_start():
    x = np.ones(10 * ENERGY_WINDOW, np.float32)
    x[6 * ENERGY_WINDOW: 7 * ENERGY_WINDOW] = 0.01
    assert quietest_window_start(x, 2 * ENERGY_WINDOW, 10 * ENERGY_WINDOW) == 6 * ENERGY_WINDOW
    assert quietest_window_start(x, 5, 100) == 5  # shorter than a window


def test_log_mel_shape_and_padding():
    feats = log_mel(_noise(3.0))
    assert feats.shape == (80, NUM_FRAMES) and feats.dtype == np.float32
    # Whisper pads to 30 s: the frames past the audio are all equal (the clamped floor).
    assert np.ptp(feats[:, 400:]) < 1e-5 and np.ptp(feats[:, :250]) > 0.1
    assert log_mel(_noise(1.0), n_mels=128).shape == (128, NUM_FRAMES)
    with pytest.raises(ValueError, match="at most 30 s"):
        log_mel(_noise(31))
