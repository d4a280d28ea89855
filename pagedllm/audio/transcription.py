"""One transcription, engine-agnostic: audio → engine requests (one per 30 s window) → ``Transcript``.

The server (``serving_transcription.py``, async, windows as concurrent requests) and ``pagedllm transcribe``
(``LLM.generate``) both drive this class; it never talks to an engine itself. A request is an ordinary engine
request whose prompt is ``{"prompt_token_ids": decoder prompt, "audio_features": float32 [n_mels, 3000]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.audio.chunking import AudioChunk, split_audio
from pagedllm.audio.decode import SAMPLE_RATE, decode_audio
from pagedllm.audio.features import log_mel
from pagedllm.audio.formats import RESPONSE_FORMATS, TIMED_FORMATS, Transcript
from pagedllm.audio.segments import WindowResult, decode_text, join_windows, window_segments
from pagedllm.audio.whisper_tokens import MAX_NEW_TOKENS, TASKS, TEXT_CONTEXT, WhisperVocab
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams

# Architectures served by /v1/audio/*; every other model answers those routes with a 400.
TRANSCRIPTION_ARCHITECTURES = ("WhisperForConditionalGeneration",)
DEFAULT_MAX_DURATION_S = 3600.0  # decoded audio longer than this is refused (a small file can hold hours)


def is_transcription_model(model_config: Any) -> bool:
    return getattr(model_config, "architecture", "") in TRANSCRIPTION_ARCHITECTURES


@dataclass(frozen=True)
class TranscriptionOptions:
    """What the caller asked for; ``language`` None means detect it (multilingual models)."""

    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    response_format: str = "json"

    @property
    def timestamps(self) -> bool:
        return self.response_format in TIMED_FORMATS


@dataclass
class EngineRequest:
    prompt: dict
    params: SamplingParams


class WhisperTranscriber:
    """Builds a Whisper model's engine requests and reads their outputs, with the engine's own tokenizer."""

    def __init__(self, tokenizer: Any, n_mels: int = 80, max_model_len: int = TEXT_CONTEXT,
                 max_duration_s: float = DEFAULT_MAX_DURATION_S) -> None:
        self.tokenizer = tokenizer
        self.vocab = WhisperVocab.from_tokenizer(tokenizer)
        self.n_mels = n_mels
        self.max_model_len = max_model_len
        self.max_duration_s = max_duration_s

    @classmethod
    def for_model(cls, tokenizer: Any, model_config: Any, max_model_len: int,
                  max_duration_s: float = DEFAULT_MAX_DURATION_S) -> WhisperTranscriber:
        n_mels = getattr(getattr(model_config, "hf_config", None), "num_mel_bins", None) or 80
        return cls(tokenizer, int(n_mels), max_model_len, max_duration_s)

    # ---- validation and audio ----------------------------------------------------------------------------
    def check(self, options: TranscriptionOptions) -> TranscriptionOptions:
        """The options with the language resolved to a code; ValueError naming the field otherwise."""
        if options.task not in TASKS:
            raise ValueError(f"task: must be one of {', '.join(TASKS)}, got {options.task!r}")
        if options.response_format not in RESPONSE_FORMATS:
            raise ValueError(f"response_format: must be one of {', '.join(RESPONSE_FORMATS)}, "
                             f"got {options.response_format!r}")
        if not 0.0 <= options.temperature <= 1.0:
            raise ValueError(f"temperature: must be between 0 and 1, got {options.temperature}")
        if options.task == "translate" and not self.vocab.is_multilingual:
            raise ValueError("task: this model is English-only; it cannot translate")
        language = self.vocab.language_code(options.language)
        if language is None and not self.vocab.is_multilingual:
            language = "en"
        return TranscriptionOptions(options.task, language, options.prompt, options.temperature,
                                    options.response_format)

    def load_audio(self, data: bytes) -> tuple[np.ndarray, list[AudioChunk]]:
        """Decoded 16 kHz samples [n] and their windows of at most 30 s (``AudioDecodeError`` if not audio)."""
        samples = decode_audio(data, self.max_duration_s)
        return samples, split_audio(samples, SAMPLE_RATE)

    def features(self, chunk: AudioChunk) -> np.ndarray:
        return log_mel(chunk.samples, self.n_mels)

    # ---- language detection --------------------------------------------------------------------------------
    def detection_request(self, features: np.ndarray) -> EngineRequest:
        """One step after ``<|startoftranscript|>``, greedy among the language tokens only."""
        ids = list(self.vocab.language_ids.values())
        params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=ids,
                                logprobs=min(len(ids), MAX_LOGPROBS))
        return EngineRequest({"prompt_token_ids": [self.vocab.sot], "audio_features": features}, params)

    def detected_language(self, output: RequestOutput) -> str:
        by_id = {token_id: code for code, token_id in self.vocab.language_ids.items()}
        token_ids = output.outputs[0].token_ids if output.outputs else []
        if not token_ids or token_ids[0] not in by_id:
            raise RuntimeError(f"language detection returned {token_ids!r}, not a language token")
        return by_id[token_ids[0]]

    # ---- transcription -----------------------------------------------------------------------------------
    def window_request(self, features: np.ndarray, options: TranscriptionOptions) -> EngineRequest:
        """``options`` as returned by ``check`` with a language (given or detected)."""
        prompt_ids = self.vocab.decoder_prompt(self.tokenizer, options.language or "en", options.task,
                                               options.timestamps, options.prompt)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt: the decoder prompt of {len(prompt_ids)} tokens leaves no room in the "
                             f"model's {self.max_model_len}-token context")
        params = SamplingParams(max_tokens=min(MAX_NEW_TOKENS, room), temperature=options.temperature,
                                logprobs=0 if options.response_format == "verbose_json" else None)
        return EngineRequest({"prompt_token_ids": prompt_ids, "audio_features": features}, params)

    def window_result(self, chunk: AudioChunk, index: int, token_ids: list[int],
                      logprobs: list[float] | None, options: TranscriptionOptions) -> WindowResult:
        result = WindowResult(chunk.start_s, chunk.duration_s, list(token_ids), logprobs, options.temperature)
        if options.timestamps:
            result.segments = window_segments(self.vocab, self.tokenizer, result.token_ids, chunk.start_s,
                                              chunk.duration_s, index)
            result.text = "".join(s.text for s in result.segments)
        else:
            result.text = decode_text(self.vocab, self.tokenizer, result.token_ids)
        return result

    def transcript(self, options: TranscriptionOptions, duration_s: float,
                   windows: list[WindowResult]) -> Transcript:
        text = "".join(w.text for w in windows).strip()
        language = self.vocab.language_names.get(options.language or "en", options.language or "english")
        return Transcript(options.task, language, duration_s, text, windows, join_windows(windows))


def sampled_logprobs(output: RequestOutput) -> list[float] | None:
    """The logprob of each sampled token of a finished output, when the request asked for logprobs."""
    comp = output.outputs[0]
    if comp.logprobs is None:
        return None
    return [entry[t].logprob for t, entry in zip(comp.token_ids, comp.logprobs, strict=False) if t in entry]
