"""Decoding uploads: every container/codec the API accepts lands as the same 16 kHz mono float32 audio."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.audio.decode import SAMPLE_RATE, AudioDecodeError, decode_audio

from helpers.whisper_fakes import pyav_encode, sox_convert, wav_bytes


@pytest.fixture(scope="module")
def reference(speech_wav):
    return decode_audio(speech_wav)


def _envelope(x: np.ndarray, frame: int = 160) -> np.ndarray:
    n = x.size // frame
    return np.sqrt(np.mean(np.square(x[: n * frame].reshape(n, frame)), axis=1))


def _assert_same_speech(got: np.ndarray, ref: np.ndarray, max_lag_frames: int = 10) -> None:
    """Same length within the codec's padding, and the same loudness envelope (10 ms frames, a small lag)."""
    assert got.dtype == np.float32 and got.ndim == 1
    assert abs(got.size - ref.size) < 0.1 * SAMPLE_RATE, (got.size, ref.size)
    a, b = _envelope(got), _envelope(ref)
    n = min(a.size, b.size) - max_lag_frames
    best = max(np.corrcoef(a[k:k + n], b[:n])[0, 1] for k in range(max_lag_frames))
    assert best > 0.95, best


def test_wav_is_resampled_to_16k_mono(speech_wav, reference):
    # espeak-ng writes 22.05 kHz: 3.73 s of speech must stay 3.73 s at 16 kHz.
    import io
    import wave

    with wave.open(io.BytesIO(speech_wav)) as w:
        seconds = w.getnframes() / w.getframerate()
        assert w.getframerate() == 22050
    assert reference.size == pytest.approx(seconds * SAMPLE_RATE, abs=SAMPLE_RATE * 0.01)
    assert 0.05 < np.abs(reference).max() <= 1.0


@pytest.mark.parametrize("suffix", ["flac", "ogg"])
def test_sox_formats(speech_wav, reference, suffix):
    _assert_same_speech(decode_audio(sox_convert(speech_wav, suffix)), reference)


@pytest.mark.parametrize("container,codec,rate", [("mp3", "libmp3lame", 22050), ("ipod", "aac", 44100),
                                                  ("webm", "libopus", 48000)])
def test_pyav_formats(reference, container, codec, rate):
    # m4a (AAC in an MPEG-4 container: FFmpeg's "ipod" muxer) and webm/Opus are what browsers record.
    data = pyav_encode(reference, SAMPLE_RATE, container, codec, out_rate=rate)
    _assert_same_speech(decode_audio(data), reference)


def test_stereo_is_mixed_to_mono(reference):
    data = pyav_encode(reference, SAMPLE_RATE, "mp3", "libmp3lame", out_rate=44100, channels=2)
    _assert_same_speech(decode_audio(data), reference)


def test_empty_and_not_audio_are_decode_errors():
    with pytest.raises(AudioDecodeError, match="empty"):
        decode_audio(b"")
    with pytest.raises(AudioDecodeError, match="file: could not decode"):
        decode_audio(b"this is plain text, not audio at all " * 20)
    with pytest.raises(AudioDecodeError):
        decode_audio(wav_bytes(np.zeros(0, np.float32)))  # a valid header with no samples


def test_duration_cap(reference):
    with pytest.raises(AudioDecodeError, match="longer than the limit of 2 s"):
        decode_audio(wav_bytes(np.zeros(3 * SAMPLE_RATE, np.float32)), max_duration_s=2)
    assert decode_audio(wav_bytes(np.zeros(SAMPLE_RATE, np.float32)), max_duration_s=2).size == SAMPLE_RATE
