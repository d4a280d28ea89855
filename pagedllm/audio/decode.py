"""Uploaded bytes → 16 kHz mono float32 samples, with PyAV (FFmpeg): wav, flac, mp3, ogg, m4a/AAC, webm/Opus."""

from __future__ import annotations

import io

import numpy as np

SAMPLE_RATE = 16_000  # what Whisper's feature extractor expects


class AudioDecodeError(ValueError):
    """The upload is empty, is not audio FFmpeg can read, or decodes to nothing / to too much."""


def decode_audio(data: bytes, max_duration_s: float | None = None) -> np.ndarray:
    """Decode and resample in one pass (``av.AudioResampler``: any rate and layout → 16 kHz mono float32).

    Returns float32 samples ``[num_samples]`` in [-1, 1]. Decoding stops as soon as the audio passes
    ``max_duration_s`` (a small compressed file may hold hours), which raises ``AudioDecodeError``.
    """
    import av

    if not data:
        raise AudioDecodeError("file: the uploaded file is empty")
    limit = None if max_duration_s is None else int(max_duration_s * SAMPLE_RATE)
    parts: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioDecodeError("file: the uploaded file has no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            frames = (f for packet in container.demux(stream) for f in packet.decode())
            for frame in _then_flush(frames):
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)  # packed flt mono: [1, n]
                    parts.append(samples)
                    total += samples.size
                if limit is not None and total > limit:
                    raise AudioDecodeError(f"file: the audio is longer than the limit of {max_duration_s:g} s")
    except AudioDecodeError:
        raise
    except (av.FFmpegError, ValueError, IndexError, OSError) as e:
        raise AudioDecodeError(f"file: could not decode the upload as audio ({type(e).__name__}: {e})") from None
    if total == 0:
        raise AudioDecodeError("file: the upload holds no audio samples")
    return np.clip(np.concatenate(parts), -1.0, 1.0).astype(np.float32, copy=False)


def _then_flush(frames):
    """The decoded frames, then None: the resampler's cue to return what it still holds."""
    yield from frames
    yield None
