"""Whisper's decoding ids, gathered once at resolution: from a CTranslate2 folder's config (already on the
``WhisperConfig``, ``loader/ct2_whisper.py``) or an HF folder's ``generation_config.json``."""

from __future__ import annotations

import json
import os

from pagedllm.config import ModelConfig

# generation_config.json keys the engine's Whisper decoding rules read (sample/whisper_rules.py).
_GENERATION_KEYS = ("suppress_tokens", "begin_suppress_tokens", "no_timestamps_token_id",
                    "max_initial_timestamp_index", "lang_to_id", "task_to_id", "is_multilingual",
                    "decoder_start_token_id")


def finish_whisper_config(mc: ModelConfig, folder: str) -> int:
    """Copy an HF folder's Whisper generation settings onto ``mc.hf_config`` (where the config lacks them);
    returns the decoder's context length (``max_target_positions``, 448)."""
    hf_config = mc.hf_config
    path = os.path.join(folder, "generation_config.json")
    if not mc.ct2_file and os.path.isfile(path):
        with open(path) as f:
            generation = json.load(f)
        for key in _GENERATION_KEYS:
            if generation.get(key) is not None and getattr(hf_config, key, None) in (None, [], {}):
                setattr(hf_config, key, generation[key])
    return int(hf_config.max_target_positions)

