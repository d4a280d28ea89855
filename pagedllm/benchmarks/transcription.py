"""Speech-to-text throughput: ``pagedllm bench transcription``.

Transcribes the same clips twice through ``LLM.generate``: **sequential** (one file after another, as
``pagedllm transcribe`` does) and **concurrent** (every clip's windows in one call, batched continuously as the
server batches concurrent uploads). Reports clips per second and the real-time factor (processing seconds per
second of audio) of each, and every transcript, so that ``benchmarks/whisper_compare.sh`` can hold them against
faster-whisper's and transformers' on the same audio. Without ``--audio`` it speaks 16 English clips of 5-10 s
with espeak-ng (``pagedllm/benchmarks/speech_clips.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.engine_args import EngineArgs
from pagedllm.utils import gc_heap_frozen

MODES = ("sequential", "concurrent")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("transcription benchmark")
    group.add_argument("--audio", nargs="*", default=None, metavar="FILE",
                       help="Audio files to transcribe (default: --num-clips clips spoken by espeak-ng).")
    group.add_argument("--num-clips", type=int, default=16, help="Spoken clips when no --audio is given (max 16).")
    group.add_argument("--clips-dir", default=None,
                       help="Where the spoken clips are written (kept for the peers); default a temporary folder.")
    group.add_argument("--language", default="en",
                       help="Spoken language given to the model (default en); 'detect' runs language detection.")
    group.add_argument("--modes", default="sequential,concurrent",
                       help="Comma-separated: sequential, concurrent (default both).")
    group.add_argument("--warmup", type=int, default=1, help="Untimed clips transcribed first (default 1).")
    group.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:
        if action.dest == "model":
            action.help = "A Whisper model (default whisper-base), or a folder holding one."
        if action.dest == "dtype":
            action.help = f"{action.help} float32 is what the peers are timed in."
    return parser


def _clips(args: argparse.Namespace, scratch: str) -> list[Path]:
    if args.audio:
        return [Path(p) for p in args.audio]
    from pagedllm.benchmarks.speech_clips import make_clips

    return make_clips(args.clips_dir or scratch, args.num_clips)


def _concurrent(llm: Any, transcriber: Any, blobs: list[bytes], options: Any) -> list[Any]:
    """Every clip's windows (after one batched language detection where asked) in one ``LLM.generate`` call."""
    from pagedllm.audio.transcription import sampled_logprobs

    loaded = [transcriber.load_audio(b) for b in blobs]
    features = [[transcriber.features(c) for c in chunks] for _, chunks in loaded]
    per_clip = [options] * len(blobs)
    if options.language is None:
        detects = [transcriber.detection_request(f[0]) for f in features]
        outs = llm.generate([d.prompt for d in detects], [d.params for d in detects], use_tqdm=False)
        per_clip = [dataclasses.replace(options, language=transcriber.detected_language(o)) for o in outs]
    requests = [(i, transcriber.window_request(f, per_clip[i])) for i, fs in enumerate(features) for f in fs]
    outputs = iter(llm.generate([r.prompt for _, r in requests], [r.params for _, r in requests], use_tqdm=False))
    transcripts = []
    for i, (samples, chunks) in enumerate(loaded):
        windows = []
        for j, chunk in enumerate(chunks):
            out = next(outputs)
            windows.append(transcriber.window_result(chunk, j, out.outputs[0].token_ids, sampled_logprobs(out),
                                                     per_clip[i]))
        transcripts.append(transcriber.transcript(per_clip[i], samples.size / chunks[0].sample_rate, windows))
    return transcripts


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.audio.decode import SAMPLE_RATE, decode_audio
    from pagedllm.audio.transcription import TranscriptionOptions, WhisperTranscriber, is_transcription_model
    from pagedllm.entrypoints.cli.transcribe import transcribe_bytes

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes: a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    args.model = args.model or "whisper-base"
    with tempfile.TemporaryDirectory(prefix="pagedllm-clips-") as scratch:
        paths = _clips(args, scratch)
        blobs = [p.read_bytes() for p in paths]
        audio_s = sum(decode_audio(b).size / SAMPLE_RATE for b in blobs)
        llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
        mc = llm.engine.config.model
        if not is_transcription_model(mc):
            raise ValueError(f"model: {mc.model!r} is not a speech-to-text model; use --model whisper-base")
        transcriber = WhisperTranscriber.for_model(llm.get_tokenizer(), mc, llm.engine.processor.max_model_len)
        options = TranscriptionOptions(language=None if args.language == "detect" else args.language)
        for blob in blobs[:args.warmup]:
            transcribe_bytes(llm, transcriber, blob, options)
        result: dict[str, Any] = {"model": mc.model, "dtype": mc.dtype, "clips": [p.name for p in paths],
                                  "num_clips": len(paths), "audio_seconds": audio_s}
        with gc_heap_frozen():  # as in a served engine's core process
            for mode in modes:
                start = time.perf_counter()
                if mode == "sequential":
                    transcripts = [transcribe_bytes(llm, transcriber, b, options) for b in blobs]
                else:
                    transcripts = _concurrent(llm, transcriber, blobs, options)
                elapsed = time.perf_counter() - start
                result[mode] = {"elapsed_s": elapsed, "clips_per_s": len(blobs) / elapsed,
                                "real_time_factor": elapsed / audio_s, "texts": [t.text for t in transcripts]}
                print(f"{mode}: {len(blobs)} clips ({audio_s:.1f} s of audio) in {elapsed:.2f} s: "
                      f"{len(blobs) / elapsed:.2f} clips/s, real-time factor {elapsed / audio_s:.3f}")
    if len(modes) == 2:
        same = sum(a == b for a, b in zip(result["sequential"]["texts"], result["concurrent"]["texts"]))
        result["concurrent_equals_sequential"] = same
        print(f"concurrent transcripts equal to sequential: {same}/{len(blobs)}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
