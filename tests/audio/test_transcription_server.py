"""The audio routes through the real FastAPI app and the official ``openai`` client, with a fake Whisper engine
(no model): formats, long audio as concurrent windows, language detection, streaming, errors, 413, metrics."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import numpy as np
import openai
import pytest

from pagedllm.audio.decode import SAMPLE_RATE, decode_audio
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import ServerOptions, build_app
from pagedllm.metrics.prometheus import PrometheusMetrics

from helpers.whisper_fakes import FakeWhisperEngine, pyav_encode, wav_bytes, whisper_tokenizer


@contextlib.asynccontextmanager
async def served(engine, **options):
    llm = AsyncLLM(engine)
    try:
        metrics = PrometheusMetrics("whisper-base", 448, 448)
        app = build_app(llm, ServerOptions(served_model_names=["whisper-base"], **options), metrics)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30)
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
        yield client, http
        await http.aclose()
    finally:
        llm.shutdown(1)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def clip(speech_wav) -> bytes:
    return speech_wav


def test_json_text_and_language_detection(clip):
    engine = FakeWhisperEngine(whisper_tokenizer(), text=" Hello world.", language="de")

    async def main():
        async with served(engine) as (client, _):
            got = await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", clip))
            text = await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", clip),
                                                            response_format="text", language="en")
            return got, text
    got, text = run(main())
    assert got.text == "Hello world." and text.strip() == "Hello world."
    v = engine.vocab
    prompts = [p for p, _, _ in engine.seen]
    # First request: detection (greedy over the language tokens only), then the window in German.
    assert prompts[0] == [v.sot] and engine.seen[0][2].allowed_token_ids == list(v.language_ids.values())
    assert engine.seen[0][2].max_tokens == 1 and engine.seen[0][2].temperature == 0
    assert prompts[1] == [v.sot, v.language_ids["de"], v.transcribe, v.no_timestamps]
    assert prompts[2] == [v.sot, v.language_ids["en"], v.transcribe, v.no_timestamps]  # given: no detection
    # The features are the clip's log-mel: not the padding floor everywhere.
    assert np.ptp(engine.seen[1][1][:, :300]) > 0.5


def test_verbose_json_srt_vtt_and_prompt(clip):
    engine = FakeWhisperEngine(whisper_tokenizer(), text=" Hello world.", end_s=1.5)

    async def main():
        async with served(engine) as (client, _):
            verbose = await client.audio.transcriptions.create(
                model="whisper-base", file=("a.flac", clip), response_format="verbose_json", language="english",
                prompt="Earlier words.", timestamp_granularities=["segment"], temperature=0.0)
            srt = await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", clip),
                                                           response_format="srt", language="en")
            vtt = await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", clip),
                                                           response_format="vtt", language="en")
            return verbose, srt, vtt
    verbose, srt, vtt = run(main())
    assert verbose.language == "english" and verbose.text == "Hello world."
    assert verbose.duration == pytest.approx(decode_audio(clip).size / SAMPLE_RATE, abs=1e-3)
    [seg] = verbose.segments
    assert (seg.id, seg.seek, seg.start, seg.end, seg.text) == (0, 0, 0.0, 1.5, " Hello world.")
    assert seg.avg_logprob < 0 and seg.tokens[0] == engine.vocab.timestamp_begin
    assert srt == "1\n00:00:00,000 --> 00:00:01,500\nHello world.\n"
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello world.")
    v = engine.vocab
    prompt = engine.seen[0][0]
    assert prompt[0] == v.sot_prev and prompt[-3:] == [v.sot, v.language_ids["en"], v.transcribe]  # timestamps on
    assert engine.seen[0][2].logprobs == 0  # verbose_json asks for the sampled tokens' logprobs


def test_long_audio_windows_run_together_and_keep_true_offsets():
    rng = np.random.default_rng(0)
    audio = (rng.standard_normal(int(65 * SAMPLE_RATE)) * 0.2).astype(np.float32)
    audio[int(29.5 * SAMPLE_RATE):int(29.6 * SAMPLE_RATE)] = 0  # the first cut lands here
    words = iter([" one.", " two.", " three."])
    tok = whisper_tokenizer()

    def script(prompt, features, params):
        v = engine.vocab
        ids = tok.encode(next(words), add_special_tokens=False)
        return [v.timestamp_begin + 10, *ids, v.timestamp_begin + 100, v.eot]  # 0.2 s .. 2.0 s in each window

    engine = FakeWhisperEngine(tok, script=script, step_s=0.01)

    async def main():
        async with served(engine) as (client, http):
            verbose = await client.audio.transcriptions.create(
                model="whisper-base", file=("long.wav", wav_bytes(audio)), response_format="verbose_json",
                language="en")
            metrics = (await http.get("/metrics")).text
            return verbose, metrics
    verbose, metrics = run(main())
    assert verbose.text == "one. two. three."
    starts = [round(s.start, 2) for s in verbose.segments]
    cut1 = 29.5
    assert starts[0] == 0.2 and starts[1] == round(cut1 + 0.2, 2)  # the true start, not 30.2
    assert 58.5 + 0.2 <= starts[2] <= 59.5 + 0.2
    assert [s.seek for s in verbose.segments][:2] == [0, 2950]
    assert 'pagedllm:audio_seconds_processed_total{model_name="whisper-base",task="transcribe"} 65.0' in metrics
    assert 'pagedllm:audio_windows_total{model_name="whisper-base",task="transcribe"} 3.0' in metrics
    assert 'pagedllm:audio_request_latency_seconds_count{model_name="whisper-base",task="transcribe"} 1.0' in metrics
    assert 'pagedllm:audio_requests_total{model_name="whisper-base",task="translate"} 0.0' in metrics


def test_windows_are_in_flight_together():
    audio = (np.random.default_rng(1).standard_normal(int(70 * SAMPLE_RATE)) * 0.2).astype(np.float32)
    engine = FakeWhisperEngine(whisper_tokenizer(), step_s=0.01)
    peak = 0
    original = engine.step

    def step():
        nonlocal peak
        peak = max(peak, len(engine.pending))
        return original()
    engine.step = step

    async def main():
        async with served(engine) as (client, _):
            return await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", wav_bytes(audio)),
                                                            language="en")
    assert run(main()).text == "Hello world. Hello world. Hello world."
    assert peak == 3


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks translations so
def test_translation_and_stream(clip):
    engine = FakeWhisperEngine(whisper_tokenizer(), text=" Good morning, everyone.")

    async def main():
        async with served(engine) as (client, http):
            tr = await client.audio.translations.create(model="whisper-base", file=("a.wav", clip))
            stream = await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", clip),
                                                              language="en", stream=True)
            events = [e async for e in stream]
            raw = await http.post("/v1/audio/transcriptions", files={"file": ("a.wav", clip)},
                                  data={"language": "en", "stream": "true", "stream_include_usage": "true"})
            return tr, events, raw.text
    tr, events, raw = run(main())
    assert tr.text == "Good morning, everyone."
    v = engine.vocab
    assert engine.seen[1][0] == [v.sot, v.language_ids["en"], v.translate, v.no_timestamps]
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 2 and "".join(deltas) == "Good morning, everyone."
    assert events[-1].type == "transcript.text.done" and events[-1].text == "Good morning, everyone."
    assert '"usage": {"type": "duration"' in raw and raw.rstrip().endswith("data: [DONE]")


def test_errors_are_4xx_and_the_server_keeps_serving(clip):
    engine = FakeWhisperEngine(whisper_tokenizer())

    async def main():
        async with served(engine) as (client, http):
            async def post(files=None, **data):
                r = await http.post("/v1/audio/transcriptions", files=files, data=data)
                return r.status_code, r.json()["error"]
            results = {
                "not audio": await post({"file": ("a.wav", b"definitely not audio " * 50)}),
                "empty": await post({"file": ("a.wav", b"")}),
                "no file": await post(None, model="whisper-base"),
                "language": await post({"file": ("a.wav", clip)}, language="klingon"),
                "format": await post({"file": ("a.wav", clip)}, response_format="xml"),
                "model": await post({"file": ("a.wav", clip)}, model="gpt-4"),
                "word": await post({"file": ("a.wav", clip)}, response_format="verbose_json",
                                   **{"timestamp_granularities[]": "word"}),
                "temperature": await post({"file": ("a.wav", clip)}, temperature="3"),
            }
            with pytest.raises(openai.BadRequestError, match="file"):
                await client.audio.transcriptions.create(model="whisper-base", file=("x.mp3", b"nope" * 100))
            after = await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", clip))
            return results, after
    results, after = run(main())
    for name, (status, err) in results.items():
        if name == "model":  # an unknown model is not found (vLLM's status)
            assert status == 404 and err["type"] == "NotFoundError", (status, err)
            continue
        assert status == 400, (name, status, err)
        assert err["type"] == "BadRequestError" and err["message"], name
    assert results["not audio"][1]["param"] == "file" and "decode" in results["not audio"][1]["message"]
    assert "empty" in results["empty"][1]["message"] and results["no file"][1]["param"] == "file"
    assert results["language"][1]["param"] == "language" and results["model"][1]["param"] == "model"
    assert results["word"][1]["param"] == "timestamp_granularities"
    assert after.text == "Hello world."


def test_upload_limit_is_413_and_its_own():
    engine = FakeWhisperEngine(whisper_tokenizer())
    silence = wav_bytes(np.zeros(SAMPLE_RATE * 40, np.float32))  # 1.28 MB
    ok = pyav_encode(np.zeros(SAMPLE_RATE, np.float32), SAMPLE_RATE, "mp3", "libmp3lame")

    async def main():
        # The general body limit is smaller than the audio limit: audio routes answer to theirs only.
        async with served(engine, max_body_bytes=100_000, max_audio_file_bytes=1_000_000) as (client, http):
            big = await http.post("/v1/audio/transcriptions", files={"file": ("a.wav", silence)})
            small = await http.post("/v1/audio/transcriptions", files={"file": ("a.mp3", ok)},
                                    data={"language": "en"})
            just_over = await http.post("/v1/audio/transcriptions",
                                        files={"file": ("a.wav", silence[:1_000_100])})  # under the form slack
            chat = await http.post("/v1/chat/completions", content=b"x" * 200_000,
                                   headers={"content-type": "application/json"})
            return big, small, just_over, chat
    big, small, just_over, chat = run(main())
    assert big.status_code == 413 and "--max-audio-file-size-mb" in big.json()["error"]["message"]
    assert just_over.status_code == 413 and "1000100 bytes" in just_over.json()["error"]["message"]
    assert small.status_code == 200 and small.json()["text"] == "Hello world."
    assert chat.status_code == 413 and "Request body of 200000 bytes" in chat.json()["error"]["message"]


def test_text_model_refuses_audio(clip):
    engine = FakeWhisperEngine(whisper_tokenizer())
    engine.config.model.architecture = "LlamaForCausalLM"

    async def main():
        async with served(engine) as (_, http):
            r = await http.post("/v1/audio/transcriptions", files={"file": ("a.wav", clip)})
            return r.status_code, r.json()["error"]
    status, err = run(main())
    assert status == 400 and err["param"] == "model"
    assert "`whisper-base` is not a speech-to-text model" in err["message"]


def test_stream_of_long_audio_keeps_window_order():
    # Window 0 says more than window 1, so window 1 finishes first: its text must wait for window 0's.
    tok = whisper_tokenizer()
    texts = {0: " The first window says a good many words before it ends.", 1: " Second."}

    def script(prompt, features, params):
        v = engine.vocab
        window = 0 if features.mean() > marker else 1
        return [*tok.encode(texts[window], add_special_tokens=False), v.eot]

    rng = np.random.default_rng(2)
    loud = (rng.standard_normal(int(29.5 * SAMPLE_RATE)) * 0.5).astype(np.float32)
    audio = np.concatenate([loud, np.zeros(int(5.5 * SAMPLE_RATE), np.float32)])  # cut at 29.5 s: all silence after
    marker = -1.0  # the log-mel of loud noise is far above that of silence (all at the -1.5 floor)
    engine = FakeWhisperEngine(tok, script=script, step_s=0.005)

    async def main():
        async with served(engine) as (client, _):
            stream = await client.audio.transcriptions.create(model="whisper-base", file=("a.wav", wav_bytes(audio)),
                                                              language="en", stream=True)
            return [e async for e in stream]
    events = run(main())
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    expected = (texts[0] + texts[1]).strip()
    assert "".join(deltas) == expected and events[-1].text == expected
    assert deltas[-1].strip() == "Second." and len(deltas) > 5  # window 1 came in one piece, after window 0


def test_chunked_upload_over_the_audio_limit_is_413():
    engine = FakeWhisperEngine(whisper_tokenizer())

    async def body():
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n"
        for _ in range(40):
            yield b"\0" * 50_000
        yield b"\r\n--b--\r\n"

    async def main():
        async with served(engine, max_audio_file_bytes=1_000_000) as (_, http):
            return await http.post("/v1/audio/transcriptions", content=body(),
                                   headers={"content-type": "multipart/form-data; boundary=b"})
    r = run(main())
    assert r.status_code == 413 and "--max-audio-file-size-mb" in r.json()["error"]["message"]
