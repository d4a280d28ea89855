"""``pagedllm transcribe FILE...``: speech to text offline, one file after another (a progress bar over the
files); the 30 s windows of each file run as one batch. Prints each transcript, or writes one file per input
with ``--output-dir``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from pagedllm.audio.formats import RESPONSE_FORMATS, Transcript, render
from pagedllm.audio.transcription import (
    DEFAULT_MAX_DURATION_S,
    TranscriptionOptions,
    WhisperTranscriber,
    is_transcription_model,
    sampled_logprobs,
)
from pagedllm.engine_args import EngineArgs

DEFAULT_TRANSCRIBE_MODEL = "whisper-base"
SUFFIXES = {"json": "json", "text": "txt", "verbose_json": "json", "srt": "srt", "vtt": "vtt"}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="Audio files (wav, flac, mp3, ogg, m4a, webm, ...: whatever FFmpeg reads).")
    parser.add_argument("--language", default=None,
                        help="Spoken language, as a code ('en') or a name ('German'); default: detected from the "
                             "first 30 s of each file (multilingual models).")
    parser.add_argument("--task", default="transcribe", choices=["transcribe", "translate"],
                        help="transcribe keeps the spoken language; translate writes English.")
    parser.add_argument("--response-format", default="text", choices=list(RESPONSE_FORMATS),
                        help="What to print: text, json, verbose_json (segments with times), srt or vtt subtitles.")
    parser.add_argument("--prompt", default=None,
                        help="Previous text, to carry on its spelling and style (Whisper's initial prompt).")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 = greedy.")
    parser.add_argument("--output-dir", default=None, type=Path,
                        help="Write FILE's transcript to DIR/<name>.<txt|json|srt|vtt> instead of printing it.")
    parser.add_argument("--max-audio-duration-s", type=float, default=DEFAULT_MAX_DURATION_S,
                        help="Refuse files whose decoded audio is longer than this.")
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:  # the engine flags' --model help names the text default
        if action.dest == "model":
            action.help = (f"A Whisper model: {DEFAULT_TRANSCRIBE_MODEL} (default; multilingual) or whisper-tiny.en "
                           "(English only), or a folder holding one.")
    return parser


def transcribe_bytes(llm: Any, transcriber: WhisperTranscriber, data: bytes,
                     options: TranscriptionOptions) -> Transcript:
    """One file through an offline engine (``LLM.generate``): detection if needed, then all windows at once."""
    options = transcriber.check(options)
    samples, chunks = transcriber.load_audio(data)
    features = [transcriber.features(c) for c in chunks]
    if options.language is None:
        detect = transcriber.detection_request(features[0])
        [out] = llm.generate([detect.prompt], detect.params, use_tqdm=False)
        options = dataclasses.replace(options, language=transcriber.detected_language(out))
    requests = [transcriber.window_request(f, options) for f in features]
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=False)
    windows = [transcriber.window_result(chunk, i, out.outputs[0].token_ids, sampled_logprobs(out), options)
               for i, (chunk, out) in enumerate(zip(chunks, outputs, strict=True))]
    return transcriber.transcript(options, samples.size / chunks[0].sample_rate, windows)


def run_files(llm: Any, files: list[Path], options: TranscriptionOptions, out: TextIO,
              output_dir: Path | None = None, max_duration_s: float = DEFAULT_MAX_DURATION_S) -> int:
    """Transcribe each file; returns how many failed (each failure is reported and the rest carry on)."""
    from tqdm import tqdm

    model_config = llm.engine.config.model
    if not is_transcription_model(model_config):
        raise ValueError(f"model: {model_config.model!r} is not a speech-to-text model; use --model whisper-base")
    transcriber = WhisperTranscriber.for_model(llm.get_tokenizer(), model_config,
                                               llm.engine.processor.max_model_len, max_duration_s)
    transcriber.check(options)  # bad options fail before any file is read
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    bar = tqdm(files, desc="Transcribing" if options.task == "transcribe" else "Translating", unit="file",
               disable=len(files) < 2, file=sys.stderr)
    for path in bar:
        try:
            transcript = transcribe_bytes(llm, transcriber, Path(path).read_bytes(), options)
        except (OSError, ValueError) as e:
            failed += 1
            tqdm.write(f"pagedllm transcribe: {path}: {e}", file=sys.stderr)
            continue
        body = render(transcript, options.response_format)
        body = json.dumps(body, ensure_ascii=False, indent=2) + "\n" if isinstance(body, dict) else body
        if output_dir is not None:
            target = output_dir / f"{Path(path).stem}.{SUFFIXES[options.response_format]}"
            target.write_text(body)
            tqdm.write(f"{path} -> {target} ({transcript.duration_s:.1f} s, {transcript.language})",
                       file=sys.stderr)
        else:
            if len(files) > 1:
                out.write(f"==> {path} <==\n")
            out.write(body if body.endswith("\n") else body + "\n")
            out.flush()
    return failed


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    args.model = args.model or DEFAULT_TRANSCRIBE_MODEL
    options = TranscriptionOptions(args.task, args.language, args.prompt, args.temperature, args.response_format)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    failed = run_files(llm, [Path(f) for f in args.files], options, sys.stdout, args.output_dir,
                       args.max_audio_duration_s)
    return 1 if failed else 0
