"""``pagedllm transcribe``: files → transcripts through an offline engine (a fake Whisper ``LLM`` here)."""

from __future__ import annotations

import io
import json

import pytest

from pagedllm.audio.transcription import TranscriptionOptions
from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.entrypoints.cli.transcribe import run_files
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

from helpers.whisper_fakes import FakeWhisperEngine, sox_convert, whisper_tokenizer


class FakeLLM:
    """``LLM.generate`` over the fake engine's scripted Whisper outputs (one call = one batch)."""

    def __init__(self, **kwargs) -> None:
        self.engine = FakeWhisperEngine(whisper_tokenizer(), **kwargs)
        self.batches: list[int] = []

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.batches.append(len(prompts))
        outs = []
        for prompt, p in zip(prompts, params):
            ids = self.engine.script(prompt["prompt_token_ids"], prompt["audio_features"], p)[: p.max_tokens]
            self.engine.seen.append((prompt["prompt_token_ids"], prompt["audio_features"], p))
            lps = [{t: Logprob(-0.5, 1)} for t in ids] if p.logprobs is not None else None
            outs.append(RequestOutput("r", None, prompt["prompt_token_ids"],
                                      [CompletionOutput(0, "", ids, logprobs=lps, finish_reason="stop")], True))
        return outs


@pytest.fixture
def files(tmp_path, speech_wav):
    a = tmp_path / "first.wav"
    a.write_bytes(speech_wav)
    b = tmp_path / "second.flac"
    b.write_bytes(sox_convert(speech_wav, "flac"))
    return [a, b]


def test_prints_each_file(files):
    llm, out = FakeLLM(text=" Hello there."), io.StringIO()
    assert run_files(llm, files, TranscriptionOptions(response_format="text"), out) == 0
    assert out.getvalue() == (f"==> {files[0]} <==\nHello there.\n==> {files[1]} <==\nHello there.\n")
    v = llm.engine.vocab
    assert [p for p, _, _ in llm.engine.seen][:2] == [[v.sot], [v.sot, v.language_ids["en"], v.transcribe,
                                                                v.no_timestamps]]


def test_output_dir_srt_and_bad_file(tmp_path, files):
    bad = tmp_path / "notes.txt"
    bad.write_text("not audio at all " * 40)
    llm = FakeLLM(end_s=2.0)
    failed = run_files(llm, [files[0], bad, files[1]], TranscriptionOptions(language="en", response_format="srt"),
                       io.StringIO(), tmp_path / "out")
    assert failed == 1
    assert (tmp_path / "out" / "first.srt").read_text() == "1\n00:00:00,000 --> 00:00:02,000\nHello world.\n"
    assert (tmp_path / "out" / "second.srt").exists() and not (tmp_path / "out" / "notes.srt").exists()


def test_verbose_json_and_translate(files):
    llm, out = FakeLLM(), io.StringIO()
    run_files(llm, files[:1], TranscriptionOptions(task="translate", language="de", response_format="verbose_json"),
              out)
    body = json.loads(out.getvalue())
    assert body["task"] == "translate" and body["language"] == "german" and body["segments"][0]["end"] == 1.5
    v = llm.engine.vocab
    assert llm.engine.seen[0][0] == [v.sot, v.language_ids["de"], v.translate]


def test_bad_options_and_text_model(files):
    with pytest.raises(ValueError, match="language"):
        run_files(FakeLLM(), files, TranscriptionOptions(language="klingon"), io.StringIO())
    llm = FakeLLM()
    llm.engine.config.model.architecture = "LlamaForCausalLM"
    with pytest.raises(ValueError, match="not a speech-to-text model"):
        run_files(llm, files, TranscriptionOptions(), io.StringIO())


def test_parser():
    args = build_parser().parse_args(["transcribe", "a.wav", "b.mp3", "--language", "de", "--task", "translate",
                                      "--response-format", "vtt"])
    assert args.files == ["a.wav", "b.mp3"] and args.language == "de" and args.task == "translate"
    assert args.response_format == "vtt" and args.model is None and callable(args.func)
