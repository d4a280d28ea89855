"""The form fields of ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (OpenAI's, plus vLLM's
``stream_include_usage``). The uploaded ``file`` is read apart from these."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIModel


class TranscriptionRequest(OpenAIModel):
    model: str | None = None
    language: str | None = None  # ISO-639-1 code or name; None: detected from the first 30 s
    prompt: str | None = None  # previous text, to carry on its style and spelling
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["segment", "word"]] = Field(default_factory=list)
    stream: bool = False
    stream_include_usage: bool = False  # vLLM's field: the final stream event carries the usage
