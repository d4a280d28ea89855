"""Long audio → windows of at most 30 s, cut where it is quietest (vLLM's rule), each with its true start.

Before each 30 s mark the last second is searched in 100 ms windows and the cut goes at the start of the one
with the least energy (RMS), so words are rarely split. Each chunk keeps the sample offset where it starts in
the original audio (vLLM stamps chunk i at i x 30 s, which drifts by up to a second per cut).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.audio.decode import SAMPLE_RATE

MAX_CLIP_S = 30.0
SEARCH_S = 1.0
ENERGY_WINDOW = 1600  # samples: 100 ms at 16 kHz


@dataclass(frozen=True)
class AudioChunk:
    """``samples`` [n] of the original audio, starting ``start_sample`` samples into it."""

    samples: np.ndarray
    start_sample: int
    sample_rate: int = SAMPLE_RATE

    @property
    def start_s(self) -> float:
        return self.start_sample / self.sample_rate

    @property
    def duration_s(self) -> float:
        return self.samples.size / self.sample_rate


def quietest_window_start(samples: np.ndarray, start: int, end: int, window: int = ENERGY_WINDOW) -> int:
    """Index (into ``samples``) of the start of the lowest-RMS ``window`` in ``samples[start:end]``.

    Windows step by ``window``; the first of equally quiet ones wins. A span shorter than a window
    gives ``start``.
    """
    span = samples[start:end]
    count = span.size // window
    if count == 0:
        return start
    energy = np.sqrt(np.mean(np.square(span[: count * window].reshape(count, window), dtype=np.float64), axis=1))
    return start + int(np.argmin(energy)) * window


def split_audio(samples: np.ndarray, sample_rate: int = SAMPLE_RATE, max_clip_s: float = MAX_CLIP_S,
                search_s: float = SEARCH_S, window: int = ENERGY_WINDOW) -> list[AudioChunk]:
    """Consecutive chunks covering ``samples`` [n] exactly once, none longer than ``max_clip_s``."""
    max_len = int(max_clip_s * sample_rate)
    search = int(search_s * sample_rate)
    chunks: list[AudioChunk] = []
    pos = 0
    while samples.size - pos > max_len:
        cut = quietest_window_start(samples, pos + max_len - search, pos + max_len, window)
        if cut <= pos:  # a search span that starts at pos (max_clip_s <= search_s): cut at the mark
            cut = pos + max_len
        chunks.append(AudioChunk(samples[pos:cut], pos, sample_rate))
        pos = cut
    chunks.append(AudioChunk(samples[pos:], pos, sample_rate))
    return chunks
