"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: multipart upload → Whisper → transcript.

The audio is decoded and cut into windows of at most 30 s off the event loop; the language (when not given) is
detected on the first window; then every window is its own engine request, all in flight together, and their
outputs are joined in order (``pagedllm/audio/``). Streaming sends the text as OpenAI's
``transcript.text.delta`` events, window after window, then ``transcript.text.done``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from pagedllm.audio.chunking import AudioChunk
from pagedllm.audio.decode import SAMPLE_RATE
from pagedllm.audio.formats import MEDIA_TYPES, render
from pagedllm.audio.segments import decode_text
from pagedllm.audio.transcription import (
    DEFAULT_MAX_DURATION_S,
    EngineRequest,
    TranscriptionOptions,
    WhisperTranscriber,
    is_transcription_model,
    sampled_logprobs,
)
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.openai.errors import OpenAIError, param_of
from pagedllm.entrypoints.openai.protocol_audio import TranscriptionRequest
from pagedllm.entrypoints.openai.serving_engine import sse, start_streams, stream_error, until_disconnect
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.entrypoints.streaming import ClosingStreamingResponse
from pagedllm.logger import init_logger
from pagedllm.metrics.audio import AudioMetrics
from pagedllm.outputs import RequestOutput
from pagedllm.utils import random_uuid

logger = init_logger(__name__)

DEFAULT_MAX_FILE_MB = 25.0  # OpenAI's upload limit
# Room for the multipart framing and the other form fields on top of the file itself.
FORM_OVERHEAD_BYTES = 256 * 1024
AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")


def upload_limit_message(size: int | None, limit: int) -> str:
    got = f"of {size} bytes " if size is not None else ""
    return (f"file: the audio upload {got}exceeds the limit of {limit} bytes "
            f"({limit / 2**20:g} MiB; the server's --max-audio-file-size-mb)")


class ServingTranscription:
    def __init__(self, engine: AsyncLLM, models: ServingModels, tokenizer: Any, model_config: Any,
                 max_model_len: int, max_file_bytes: int = int(DEFAULT_MAX_FILE_MB * 2**20),
                 max_duration_s: float = DEFAULT_MAX_DURATION_S, metrics: AudioMetrics | None = None) -> None:
        self.engine = engine
        self.models = models
        self.max_file_bytes = max_file_bytes
        self.metrics = metrics
        self.transcriber = (WhisperTranscriber.for_model(tokenizer, model_config, max_model_len, max_duration_s)
                            if is_transcription_model(model_config) else None)

    # ---- the request -------------------------------------------------------------------------------------
    async def _read_form(self, raw: Request) -> tuple[TranscriptionRequest, bytes]:
        form = await raw.form(max_files=1, max_fields=64)
        try:
            return await self._parse_form(form)
        finally:
            await form.close()  # the upload's spooled temporary file

    async def _parse_form(self, form: Any) -> tuple[TranscriptionRequest, bytes]:
        try:
            fields: dict[str, Any] = {k: v for k, v in form.items() if not isinstance(v, UploadFile)}
            granularities = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
            fields["timestamp_granularities"] = [g for g in granularities if isinstance(g, str)]
            req = TranscriptionRequest.model_validate(fields)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ())) or "form"
            raise OpenAIError(f"{where}: {err.get('msg')}", param=where.split(".")[0]) from None
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise OpenAIError("file: field required (a multipart/form-data upload of the audio)", param="file")
        if upload.size is not None and upload.size > self.max_file_bytes:
            raise OpenAIError(upload_limit_message(upload.size, self.max_file_bytes), 413, "file")
        data = await upload.read()
        if len(data) > self.max_file_bytes:
            raise OpenAIError(upload_limit_message(len(data), self.max_file_bytes), 413, "file")
        return req, data

    def _options(self, req: TranscriptionRequest, task: str) -> TranscriptionOptions:
        if "word" in req.timestamp_granularities:
            raise OpenAIError("timestamp_granularities: word timestamps are not supported; use segment",
                              param="timestamp_granularities")
        if req.timestamp_granularities and req.response_format != "verbose_json":
            raise OpenAIError("timestamp_granularities: needs response_format verbose_json",
                              param="timestamp_granularities")
        if req.stream and req.response_format not in ("json", "text"):
            raise OpenAIError(f"stream: streams text only; response_format {req.response_format} cannot stream",
                              param="stream")
        try:
            return self.transcriber.check(TranscriptionOptions(task, req.language, req.prompt, req.temperature,
                                                               req.response_format))
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None

    async def create(self, raw: Request, task: str):
        req, data = await self._read_form(raw)
        model = self.models.check(req.model)
        if self.transcriber is None:
            raise OpenAIError(f"The model `{model}` is not a speech-to-text model and does not support the "
                              f"audio API; serve a Whisper model (pagedllm serve whisper-base)", param="model")
        options = self._options(req, task)
        start = time.perf_counter()
        try:
            samples, chunks = await asyncio.to_thread(self.transcriber.load_audio, data)
            features = await asyncio.to_thread(lambda: [self.transcriber.features(c) for c in chunks])
        except ValueError as e:  # AudioDecodeError: empty, not audio, too long
            raise OpenAIError(str(e), param=param_of(str(e)) or "file") from None
        request_id = f"{'trsc' if task == 'transcribe' else 'trsl'}-{random_uuid()}"
        duration = samples.size / SAMPLE_RATE
        if options.language is None:
            options = replace(options, language=await self._detect(features[0], request_id))
        logger.debug("%s: %.2f s of audio in %d window(s), language %s", request_id, duration, len(chunks),
                     options.language)
        requests = [self.transcriber.window_request(f, options) for f in features]
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        streams = [self.engine.generate(r.prompt, r.params, f"{request_id}-{i}", kind=kind)
                   for i, r in enumerate(requests)]
        if req.stream:
            outputs = await start_streams(streams)
            return ClosingStreamingResponse(self._stream(req, options, chunks, duration, outputs, start),
                                            on_close=outputs.aclose)

        async def collect() -> Any:
            # A non-streamed request's first output is its last: watch for the client leaving from the start.
            return await self._collect(options, chunks, duration, await start_streams(streams), start)

        body = await until_disconnect(raw, collect())
        if body is None:
            return None
        if isinstance(body, dict):
            return JSONResponse(body)
        return PlainTextResponse(body, media_type=MEDIA_TYPES[options.response_format])

    async def _detect(self, features: np.ndarray, request_id: str) -> str:
        detect: EngineRequest = self.transcriber.detection_request(features)
        final = None
        try:
            async for out in self.engine.generate(detect.prompt, detect.params, f"{request_id}-lang",
                                                  kind=OutputKind.FINAL_ONLY):
                final = out
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        return self.transcriber.detected_language(final)

    def _record(self, options: TranscriptionOptions, duration: float, windows: int, start: float) -> None:
        latency = time.perf_counter() - start
        if self.metrics is not None:
            self.metrics.record(options.task, duration, windows, latency)
        logger.info("%s of %.1f s of audio (%d window%s, language %s) in %.2f s", options.task, duration, windows,
                    "" if windows == 1 else "s", options.language, latency)

    # ---- whole responses -----------------------------------------------------------------------------------
    async def _collect(self, options: TranscriptionOptions, chunks: list[AudioChunk], duration: float,
                       stream: AsyncIterator[tuple[int, RequestOutput]], start: float) -> dict | str:
        finals: dict[int, RequestOutput] = {}
        async for i, out in stream:
            if out.finished:
                finals[i] = out
        windows = [self.transcriber.window_result(chunk, i, finals[i].outputs[0].token_ids,
                                                  sampled_logprobs(finals[i]), options)
                   for i, chunk in enumerate(chunks)]
        transcript = self.transcriber.transcript(options, duration, windows)
        self._record(options, duration, len(chunks), start)
        return render(transcript, options.response_format)

    # ---- streaming -------------------------------------------------------------------------------------------
    async def _stream(self, req: TranscriptionRequest, options: TranscriptionOptions, chunks: list[AudioChunk],
                      duration: float, stream: AsyncIterator[tuple[int, RequestOutput]],
                      start: float) -> AsyncIterator[str]:
        """Deltas of window 0 live; later windows (running alongside) are buffered until their turn."""
        vocab, tokenizer = self.transcriber.vocab, self.transcriber.tokenizer
        ids: list[list[int]] = [[] for _ in chunks]
        done = [False] * len(chunks)
        sent = [""] * len(chunks)
        current = 0
        emitted = ""
        try:
            async for i, out in stream:
                ids[i] += out.outputs[0].token_ids
                done[i] = done[i] or out.finished
                while current < len(chunks):
                    text = decode_text(vocab, tokenizer, ids[current])
                    if not done[current] and text.endswith("\ufffd"):
                        text = text[:-1]  # a character split across tokens: wait for its other bytes
                    delta = text[len(sent[current]):]
                    sent[current] = text
                    if not emitted:
                        delta = delta.lstrip()
                    if delta:
                        emitted += delta
                        yield sse({"type": "transcript.text.delta", "delta": delta})
                    if not done[current]:
                        break
                    current += 1
            done_event: dict[str, Any] = {"type": "transcript.text.done", "text": "".join(sent).strip()}
            if req.stream_include_usage:
                done_event["usage"] = {"type": "duration", "seconds": round(duration, 3)}
            self._record(options, duration, len(chunks), start)
            yield sse(done_event)
        except Exception as e:  # the status line is gone; report in-band, as OpenAI does
            yield stream_error(e)
        yield sse("[DONE]")
