"""Helpers for the Whisper tests: a tiny random HF Whisper folder, speech made with espeak-ng, and transformers'
reference model on the same weights (a CTranslate2 folder's weights go through the engine's own renaming, so the
reference checks the model, and the transcripts of real speech check the renaming)."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm.model_executor.loader.ct2_whisper import whisper_generation_config

SENTENCE = "The weather is nice today. Please send me the report by Friday."
SAMPLE_RATE = 16000


def _tiny_en_folder() -> str:
    from pagedllm.model_executor.loader.packaged_models import ct2_folder

    try:
        return ct2_folder("whisper-tiny.en")
    except ValueError as e:
        pytest.skip(str(e))


def make_tiny_whisper(path: str | os.PathLike, seed: int = 0, heads: int = 4) -> str:
    """A random-weight Whisper (d 64, 2 + 2 layers, 4 heads unless told) saved as an HF folder with tiny.en's
    tokenizer."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from pagedllm.model_executor.loader.ct2_whisper import ct2_whisper_config

    folder = _tiny_en_folder()
    real = ct2_whisper_config(folder)
    config = WhisperConfig(
        vocab_size=real.vocab_size, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=real.decoder_start_token_id,
        eos_token_id=real.eos_token_id, pad_token_id=real.eos_token_id, bos_token_id=real.eos_token_id,
        suppress_tokens=list(real.suppress_tokens), begin_suppress_tokens=list(real.begin_suppress_tokens),
        architectures=["WhisperForConditionalGeneration"])
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed_positions" not in name:
                p.normal_(0.0, 0.08)
    model.generation_config = whisper_generation_config(real)
    model.save_pretrained(str(path))
    shutil.copyfile(os.path.join(folder, "tokenizer.json"), os.path.join(path, "tokenizer.json"))
    from pagedllm.model_executor.loader.tokenizer import _ct2_whisper_tokenizer

    _ct2_whisper_tokenizer(folder).save_pretrained(str(path))
    return str(path)


def load_audio(path: str) -> np.ndarray:
    """float32 mono 16 kHz samples of an audio file (PyAV)."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    chunks = []
    with av.open(path) as container:
        for frame in container.decode(audio=0):
            chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
        chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    return np.concatenate(chunks)


def speech_features(tmp: str | os.PathLike, sentence: str = SENTENCE) -> np.ndarray:
    """[80, 3000] float32 log-mel of ``sentence`` spoken by espeak-ng; skips when espeak-ng is missing."""
    from transformers import WhisperFeatureExtractor

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    wav = os.path.join(str(tmp), "clip.wav")
    subprocess.run(["espeak-ng", "-w", wav, sentence], check=True, capture_output=True, timeout=60)
    audio = load_audio(wav)
    return WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=SAMPLE_RATE,
                                                    return_tensors="np").input_features[0]


def reference_model(mc: Any) -> Any:
    """transformers' Whisper with the weights of the engine's resolved model config (CT2 or HF folder)."""
    from transformers import WhisperForConditionalGeneration

    if mc.ct2_file:
        from pagedllm.model_executor.loader.ct2_file import read_ct2_file
        from pagedllm.model_executor.loader.ct2_whisper import iter_ct2_whisper_weights

        model = WhisperForConditionalGeneration(mc.hf_config)
        state = dict(iter_ct2_whisper_weights(read_ct2_file(mc.ct2_file), mc.hf_config))
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert set(missing) <= {"proj_out.weight"} and not unexpected, (missing, unexpected)
        model.tie_weights()
    else:
        model = WhisperForConditionalGeneration.from_pretrained(mc.model_path)
    return model.eval()


def reference_generate(model: Any, mc: Any, features: np.ndarray, timestamps: bool = False,
                       max_new_tokens: int = 100) -> list[int]:
    """transformers' greedy tokens for one 30 s window (English; timestamps as asked), without the prompt.

    With timestamps, transformers' generate goes on from the last complete segment when the window's pass ends
    mid-segment (its long-form seek): the engine decodes one pass, so the first pass's raw tokens are returned.
    Without, the transcript (transformers strips the end-of-text token).
    """
    kwargs = dict(language="en", task="transcribe") if getattr(mc.hf_config, "is_multilingual", False) else {}
    with torch.inference_mode():
        out = model.generate(torch.from_numpy(np.asarray(features))[None], num_beams=1, do_sample=False,
                             return_timestamps=timestamps, max_new_tokens=max_new_tokens, return_segments=timestamps,
                             generation_config=whisper_generation_config(mc.hf_config), **kwargs)
    if not timestamps:
        return out[0].tolist()
    first_pass = out["segments"][0][0]["result"].tolist()
    return first_pass[len(decoder_prompt(None, mc, timestamps=True, as_ids=False)):]


def decoder_prompt(tokenizer: Any, mc: Any, timestamps: bool = False, as_ids: bool = True) -> list:
    """The decoder prompt of an English transcription (token ids, or the tokens with ``as_ids=False``)."""
    tokens = ["<|startoftranscript|>"]
    if getattr(mc.hf_config, "is_multilingual", False):
        tokens += ["<|en|>", "<|transcribe|>"]
    if not timestamps:
        tokens.append("<|notimestamps|>")
    return tokenizer.convert_tokens_to_ids(tokens) if as_ids else tokens
