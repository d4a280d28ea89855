"""Output token ids of each 30 s window → timed segments of the whole audio.

A window's output reads ``<|t0|> text <|t1|><|t1|> more text <|t2|> ...``: a timestamp after text closes the
segment, and a timestamp after a timestamp (or at the very start) opens the next one. Times are relative to the
window, so each is offset by the window's true start in the audio; text that no timestamp closes (a window cut
mid-sentence) becomes a segment that ends with the window, so no words are lost at a cut, and since windows do
not overlap none are repeated. Across windows times never go backwards.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from pagedllm.audio.whisper_tokens import WhisperVocab


@dataclass
class Segment:
    """One timed piece of the transcript; ``start`` / ``end`` in seconds from the start of the audio."""

    start: float
    end: float
    text: str
    tokens: list[int]
    window: int = 0  # which 30 s window it came from


@dataclass
class WindowResult:
    """What the engine returned for one window, and where that window lies in the audio (seconds)."""

    start_s: float
    duration_s: float
    token_ids: list[int]
    logprobs: list[float] | None = None  # the sampled tokens' logprobs, when asked for
    temperature: float = 0.0
    segments: list[Segment] = field(default_factory=list)
    text: str = ""

    @property
    def avg_logprob(self) -> float:
        """Whisper's per-window figure: the sampled tokens' logprobs summed over (tokens + 1)."""
        if not self.logprobs:
            return 0.0
        return sum(self.logprobs) / (len(self.logprobs) + 1)

    @property
    def compression_ratio(self) -> float:
        """Bytes of text over its zlib size (Whisper flags > 2.4 as repetitive)."""
        data = self.text.encode("utf-8")
        return len(data) / len(zlib.compress(data)) if data else 0.0


def decode_text(vocab: WhisperVocab, tokenizer: Any, token_ids: list[int]) -> str:
    """The text of token ids with every special and timestamp token left out."""
    return tokenizer.decode([t for t in token_ids if vocab.is_text(t)], skip_special_tokens=True)


def window_segments(vocab: WhisperVocab, tokenizer: Any, token_ids: list[int], start_s: float,
                    duration_s: float, window: int = 0) -> list[Segment]:
    """The segments of one window's output, timed in the whole audio and clamped to the window."""
    end_of_window = start_s + duration_s

    def at(token_id: int) -> float:
        return min(start_s + vocab.timestamp_s(token_id), end_of_window)

    segments: list[Segment] = []
    opened: int | None = None  # the timestamp that opens the current segment
    text_ids: list[int] = []
    seg_tokens: list[int] = []

    def close(end: float) -> None:
        text = decode_text(vocab, tokenizer, text_ids)
        if text.strip():
            start = at(opened) if opened is not None else start_s
            segments.append(Segment(start, max(end, start), text, list(seg_tokens), window))

    for token_id in token_ids:
        if token_id == vocab.eot:
            break
        if vocab.is_timestamp(token_id):
            if text_ids:
                seg_tokens.append(token_id)
                close(at(token_id))
                text_ids, seg_tokens = [], []
            opened = token_id
            seg_tokens = [token_id]
        elif vocab.is_text(token_id):
            text_ids.append(token_id)
            seg_tokens.append(token_id)
    if text_ids:
        close(end_of_window)
    return segments


def join_windows(windows: list[WindowResult]) -> list[Segment]:
    """All windows' segments in order, with times made non-decreasing across the cuts."""
    out: list[Segment] = []
    last_end = 0.0
    for result in windows:
        for seg in result.segments:
            start = max(seg.start, last_end)
            end = max(seg.end, start)
            out.append(Segment(start, end, seg.text, seg.tokens, seg.window))
            last_end = end
    return out
