"""The peers of ``pagedllm bench transcription`` on the same clips and the same CTranslate2 weights, greedy, English
given, 2 threads; prints and writes JSON shaped like pagedllm's (``sequential`` / ``concurrent``, clips per second,
real-time factor, texts).

  fw-venv/bin/python benchmarks/whisper_peers.py faster-whisper CT2_DIR OUT.json clip_*.wav [--compute-type int8]
  .venv/bin/python  benchmarks/whisper_peers.py transformers   CT2_DIR OUT.json clip_*.wav [--compute-type bfloat16]

faster-whisper (its own venv; never a dependency): ``WhisperModel.transcribe`` one clip after another, and for the
concurrent case its ``BatchedInferencePipeline`` over all clips at once (the clips laid end to end, each its own
chunk through ``clip_timestamps``, so one batch holds every clip). transformers: ``generate`` one clip after
another, and its ASR ``pipeline`` with batches of 8 and 16 (the best is kept), on the weights pagedllm's CT2 reader
maps onto ``WhisperForConditionalGeneration``.
"""

from __future__ import annotations

import json
import sys
import time

SAMPLE_RATE = 16000


def _load(path: str):
    # faster-whisper's venv has PyAV but not pagedllm, so pagedllm.audio.decode cannot be imported there.
    import av
    import numpy as np

    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    parts = []
    with av.open(path) as container:
        for frame in container.decode(audio=0):
            parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
        parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    return np.concatenate(parts)


def _timed(fn):
    start = time.perf_counter()
    texts = fn()
    return time.perf_counter() - start, texts


def faster_whisper(folder: str, clips: list, compute_type: str) -> dict:
    import numpy as np
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(folder, device="cpu", compute_type=compute_type, cpu_threads=2)
    greedy = dict(language="en", beam_size=1, temperature=0.0, vad_filter=False, without_timestamps=True)

    def sequential():
        return ["".join(s.text for s in model.transcribe(c, condition_on_previous_text=False, **greedy)[0]).strip()
                for c in clips]

    batched = BatchedInferencePipeline(model)
    joined = np.concatenate(clips)
    bounds = np.cumsum([0] + [c.size for c in clips]) / SAMPLE_RATE
    spans = [{"start": float(a), "end": float(b)} for a, b in zip(bounds[:-1], bounds[1:])]

    def concurrent():
        segments, _ = batched.transcribe(joined, clip_timestamps=spans, batch_size=len(clips), **greedy)
        return [s.text.strip() for s in segments]

    sequential()  # warm-up
    return {"engine": f"faster-whisper {compute_type}", "sequential": _timed(sequential),
            "concurrent": _timed(concurrent)}


def transformers_peer(folder: str, clips: list, compute_type: str = "float32") -> dict:
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration, pipeline

    from pagedllm.model_executor.loader.ct2_file import read_ct2_file
    from pagedllm.model_executor.loader.ct2_whisper import (
        ct2_whisper_config,
        iter_ct2_whisper_weights,
        whisper_generation_config,
    )
    from pagedllm.model_executor.loader.tokenizer import _ct2_whisper_tokenizer

    torch.set_num_threads(2)
    config = ct2_whisper_config(folder)
    model = WhisperForConditionalGeneration(config)
    model.load_state_dict(dict(iter_ct2_whisper_weights(read_ct2_file(f"{folder}/model.bin"), config)), strict=False)
    model.tie_weights()
    dtype = getattr(torch, compute_type)  # float32 or bfloat16
    model.to(dtype).eval()
    model.generation_config = whisper_generation_config(config)
    tokenizer = _ct2_whisper_tokenizer(folder)
    extractor = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    kwargs = dict(language="en", task="transcribe", num_beams=1, do_sample=False)

    def sequential():
        texts = []
        with torch.inference_mode():
            for clip in clips:
                feats = extractor(clip, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features.to(dtype)
                ids = model.generate(feats, **kwargs)
                texts.append(tokenizer.decode(ids[0], skip_special_tokens=True).strip())
        return texts

    asr = pipeline("automatic-speech-recognition", model=model, tokenizer=tokenizer, feature_extractor=extractor,
                   device="cpu", dtype=dtype)
    if asr.tokenizer.pad_token_id is None:  # the pipeline batches only with a pad token; Whisper pads with EOS
        asr.tokenizer.pad_token_id = model.config.eos_token_id

    def batched(size: int):
        def run():
            with torch.inference_mode():
                outs = asr([c.copy() for c in clips], batch_size=size, generate_kwargs=kwargs)
            return [o["text"].strip() for o in outs]
        return run

    sequential()  # warm-up
    seq = _timed(sequential)
    best = min((_timed(batched(size)) for size in (8, 16)), key=lambda r: r[0])
    return {"engine": f"transformers {compute_type}", "sequential": seq, "concurrent": best}


def main(argv: list[str]) -> int:
    engine, folder, out_path, *rest = argv
    compute_type = "float32"
    if "--compute-type" in rest:
        i = rest.index("--compute-type")
        compute_type = rest[i + 1]
        del rest[i:i + 2]
    clips = [_load(p) for p in rest]
    audio_s = sum(c.size for c in clips) / SAMPLE_RATE
    raw = faster_whisper(folder, clips, compute_type) if engine == "faster-whisper" else \
        transformers_peer(folder, clips, compute_type)
    result = {"engine": raw["engine"], "num_clips": len(clips), "audio_seconds": audio_s}
    for mode in ("sequential", "concurrent"):
        elapsed, texts = raw[mode]
        result[mode] = {"elapsed_s": elapsed, "clips_per_s": len(clips) / elapsed,
                        "real_time_factor": elapsed / audio_s, "texts": texts}
        print(f"{raw['engine']} {mode}: {len(clips) / elapsed:.2f} clips/s, real-time factor {elapsed / audio_s:.3f}")
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
