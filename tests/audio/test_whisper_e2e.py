"""End to end on the real Whisper base (CT2 package, ``whisper-base``): ``pagedllm transcribe`` offline and
``pagedllm serve whisper-base`` through the ``openai`` client, on clips spoken by espeak-ng.

These need the Whisper engine (model, CT2 loader, decoding rules); the API half is tested without a model in
the other files of this folder.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from pagedllm.audio.decode import SAMPLE_RATE, decode_audio

from helpers.whisper_fakes import SPEECH, spoken_wav, wav_bytes

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SECOND = "The quick brown fox jumps over the lazy dog."


def _words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def _long_clip() -> bytes:
    """~45 s: the first sentence, silence past the 30 s mark, the second sentence (resampled to 16 kHz)."""
    first, second = decode_audio(spoken_wav(SPEECH)), decode_audio(spoken_wav(SECOND))
    gap = np.zeros(int(40 * SAMPLE_RATE) - first.size, np.float32)
    return wav_bytes(np.concatenate([first, gap, second]))


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-whisper-{port}.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli.serve", "whisper-base", "--host",
                             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "256MiB",
                             "--uvicorn-log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"whisper-base server did not start:\n{log.read()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=300)


def test_transcribe_json_detects_english(client):
    got = client.audio.transcriptions.create(model="whisper-base", file=("hello.wav", spoken_wav()),
                                             response_format="verbose_json")
    assert got.language == "english"
    assert {"hello", "world", "test"} <= set(_words(got.text)), got.text
    assert got.segments and all(0 <= s.start < s.end <= got.duration + 0.01 for s in got.segments)
    plain = client.audio.transcriptions.create(model="whisper-base", file=("hello.wav", spoken_wav()),
                                               language="en")
    assert _words(plain.text)[:2] == ["hello", "world"], plain.text


def test_bad_upload_is_400(server):
    # The tests after this one show the server still serving.
    r = httpx.post(f"{server}/v1/audio/transcriptions", files={"file": ("x.wav", b"not audio" * 100)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_long_audio_keeps_both_halves_in_order(client):
    got = client.audio.transcriptions.create(model="whisper-base", file=("long.wav", _long_clip()),
                                             language="en", response_format="verbose_json")
    words = _words(got.text)
    assert "hello" in words and "fox" in words and words.index("hello") < words.index("fox"), got.text
    starts = [s.start for s in got.segments]
    assert starts == sorted(starts)
    # The second sentence is in the window cut in the silence between 29 and 30 s: its times count from that
    # cut (Whisper often opens a segment at <|0.00|> after leading silence), and it ends after 40 s.
    [fox] = [s for s in got.segments if "fox" in _words(s.text)]
    assert 29.0 <= fox.start <= 40.5 and fox.end >= 40.5, (fox.start, fox.end)
    assert got.duration == pytest.approx(40 + len(decode_audio(spoken_wav(SECOND))) / SAMPLE_RATE, abs=0.05)


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks translations so
def test_stream_srt_and_translation(client, server):
    events = list(client.audio.transcriptions.create(model="whisper-base", file=("a.wav", spoken_wav()),
                                                     language="en", stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert events[-1].type == "transcript.text.done" and deltas.strip() == events[-1].text.strip()
    assert "hello" in _words(deltas)
    srt = client.audio.transcriptions.create(model="whisper-base", file=("a.wav", spoken_wav()), language="en",
                                             response_format="srt")
    assert srt.startswith("1\n00:00:0") and "-->" in srt
    tr = client.audio.translations.create(model="whisper-base", file=("a.wav", spoken_wav()))
    assert "hello" in _words(tr.text)
    metrics = httpx.get(f"{server}/metrics").text
    assert 'pagedllm:audio_seconds_processed_total{model_name="whisper-base",task="translate"}' in metrics


def test_cli_transcribe_english_only_model(tmp_path):
    # whisper-tiny.en: no language or task token in its prompt; the CLI's json format.
    clip = tmp_path / "hello.wav"
    clip.write_bytes(spoken_wav())
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli.main", "transcribe", str(clip),
                           "--model", "whisper-tiny.en", "--response-format", "json", "--dtype", "float32",
                           "--kv-cache-memory", "256MiB"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.load(io.StringIO(proc.stdout))
    assert _words(body["text"])[:2] == ["hello", "world"], body
