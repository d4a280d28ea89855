"""An encoder-decoder prompt's encoder input (Whisper's ``audio_features``): checked once in the front end,
carried across the engine-process boundary as raw bytes + shape.

The features are float32 [n_mels, 3000]: one 30 s window of log-mel, as transformers' ``WhisperFeatureExtractor``
makes it. Across ZMQ they travel as the array's bytes (960 kB for 80 mels) and its shape in the ``ADD`` message
(``EngineCoreRequest.encoder_input``): msgpack copies bytes as they are, and the engine side wraps them in an
array without another copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.config import ModelConfig


def expected_audio_shape(mc: ModelConfig) -> tuple[int, int]:
    """(n_mels, frames) a Whisper model's encoder takes: frames = 2 x its encoder positions (3000)."""
    return int(mc.hf_config.num_mel_bins), 2 * int(mc.hf_config.max_source_positions)


def check_audio_features(features: Any, mc: ModelConfig) -> np.ndarray | None:
    """``features`` as a C-contiguous float32 array for an encoder-decoder model (None for other models);
    ValueError naming ``audio_features`` when it is missing, unexpected, misshapen or not finite."""
    if not mc.is_encoder_decoder:
        if features is not None:
            raise ValueError(f"audio_features: model {mc.name!r} ({mc.architecture}) is a text model and takes no "
                             "audio; send audio to a speech-to-text model such as whisper-tiny.en")
        return None
    shape = expected_audio_shape(mc)
    if features is None:
        raise ValueError(f"audio_features: model {mc.name!r} ({mc.architecture}) transcribes audio; its prompts are "
                         "{'prompt_token_ids': [...decoder prompt...], 'audio_features': float32 "
                         f"{list(shape)} log-mel}}, and this one has no audio_features")
    if hasattr(features, "detach"):  # a torch tensor
        features = features.detach().cpu().numpy()
    try:
        array = np.ascontiguousarray(features, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"audio_features: expected a float32 array of shape {list(shape)}: {e}") from None
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]  # a feature extractor's batch of one
    if tuple(array.shape) != shape:
        raise ValueError(f"audio_features: expected shape {list(shape)} (n_mels x 30 s of frames), got "
                         f"{list(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError("audio_features: contains NaN or infinite values")
    return array


def pack_encoder_input(array: np.ndarray | None) -> tuple[bytes | None, list[int] | None]:
    """(raw bytes, shape) of a float32 array for ``EngineCoreRequest``; (None, None) for none."""
    if array is None:
        return None, None
    return array.tobytes(), list(array.shape)


def unpack_encoder_input(data: bytes | None, shape: list[int] | None) -> np.ndarray | None:
    """The array ``pack_encoder_input`` packed (a read-only view of ``data``)."""
    if data is None:
        return None
    return np.frombuffer(data, dtype=np.float32).reshape(shape or [-1])
