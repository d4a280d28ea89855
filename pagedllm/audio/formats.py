"""A finished transcript → the response formats of OpenAI's audio API: json, text, verbose_json, srt, vtt."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.audio.segments import Segment, WindowResult

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# Formats that need Whisper's timestamp tokens; json and text decode with <|notimestamps|>.
TIMED_FORMATS = ("verbose_json", "srt", "vtt")
MEDIA_TYPES = {"json": "application/json", "verbose_json": "application/json", "text": "text/plain",
               "srt": "application/x-subrip", "vtt": "text/vtt"}


@dataclass
class Transcript:
    task: str  # transcribe | translate
    language: str  # lower-case English name, as OpenAI reports it ("english")
    duration_s: float
    text: str
    windows: list[WindowResult]
    segments: list[Segment]

    def usage(self) -> dict:
        """OpenAI's usage for duration-billed models (whisper-1)."""
        return {"type": "duration", "seconds": round(self.duration_s, 3)}


def to_json(t: Transcript) -> dict:
    return {"text": t.text, "usage": t.usage()}


def to_text(t: Transcript) -> str:
    return t.text + "\n"


def to_verbose_json(t: Transcript) -> dict:
    segments = []
    for i, seg in enumerate(t.segments):
        window = t.windows[seg.window]
        segments.append({
            "id": i, "seek": round(window.start_s * 100),  # Whisper's seek: 10 ms mel frames
            "start": round(seg.start, 3), "end": round(seg.end, 3), "text": seg.text, "tokens": seg.tokens,
            "temperature": window.temperature, "avg_logprob": window.avg_logprob,
            "compression_ratio": window.compression_ratio,
            "no_speech_prob": 0.0})  # see docs/audio.md: the no-speech check is not run
    return {"task": t.task, "language": t.language, "duration": round(t.duration_s, 3), "text": t.text,
            "segments": segments, "usage": t.usage()}


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def to_srt(t: Transcript) -> str:
    blocks = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
              for i, s in enumerate(t.segments, start=1)]
    return "\n".join(blocks)


def to_vtt(t: Transcript) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in t.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


def render(t: Transcript, response_format: str) -> dict | str:
    """The body for ``response_format``: a dict for the JSON formats, text otherwise."""
    renderers = {"json": to_json, "text": to_text, "verbose_json": to_verbose_json, "srt": to_srt, "vtt": to_vtt}
    if response_format not in renderers:
        raise ValueError(f"response_format: must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}")
    return renderers[response_format](t)
