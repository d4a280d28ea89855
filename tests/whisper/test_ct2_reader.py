"""The CTranslate2 model.bin reader on a file written here, and the packaged Whisper folders it finds."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from pagedllm.model_executor.loader.ct2_file import read_ct2_file


def _text(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(path: str, variables: dict[str, np.ndarray], aliases: dict[str, str]) -> None:
    codes = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3,
             np.dtype(np.float16): 4}
    out = struct.pack("<I", 6) + _text("WhisperSpec") + struct.pack("<I", 3) + struct.pack("<I", len(variables))
    for name, array in variables.items():
        data = np.ascontiguousarray(array).tobytes()
        out += _text(name) + struct.pack("<B", array.ndim) + struct.pack("<" + "I" * array.ndim, *array.shape)
        out += struct.pack("<B", codes[array.dtype]) + struct.pack("<I", len(data)) + data
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases.items():
        out += _text(alias) + _text(target)
    with open(path, "wb") as f:
        f.write(out)


def test_reads_variables_attributes_and_aliases(tmp_path) -> None:
    weight = np.arange(12, dtype=np.float16).reshape(3, 4)
    path = str(tmp_path / "model.bin")
    write_ct2(path, {"decoder/embeddings/weight": weight, "decoder/num_heads": np.array([6], dtype=np.int16),
                     "encoder/conv1/bias": np.ones(5, np.float32)},
              {"decoder/projection/weight": "decoder/embeddings/weight"})
    ct2 = read_ct2_file(path)
    assert ct2.spec == "WhisperSpec" and ct2.revision == 3
    assert np.array_equal(ct2.get("decoder/projection/weight"), weight)  # through the alias
    assert ct2.scalar("decoder/num_heads") == 6
    assert ct2.get("encoder/conv1/bias").dtype == np.float32
    with pytest.raises(ValueError, match="no variable 'encoder/conv2/bias'"):
        ct2.get("encoder/conv2/bias")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) - 30])
    with pytest.raises(ValueError, match="ends early"):
        read_ct2_file(path)


@pytest.mark.slow
def test_packaged_folders_resolve(tmp_path) -> None:
    from pagedllm.config import ModelConfig
    from pagedllm.model_executor.loader import load_tokenizer, resolve_model_config
    from pagedllm.model_executor.loader.packaged_models import WHISPER_BASE, join_parts

    mc = resolve_model_config(ModelConfig(model="whisper-tiny.en", dtype="float32", device="cpu"))
    cfg = mc.hf_config
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers, cfg.encoder_attention_heads) == (384, 4, 4, 6)
    assert mc.is_encoder_decoder and mc.max_model_len == 448 and mc.eos_token_ids == [50256]
    assert cfg.no_timestamps_token_id == 50362 and not cfg.is_multilingual and 220 in cfg.begin_suppress_tokens
    tok = load_tokenizer(mc)
    assert tok.convert_tokens_to_ids(["<|0.00|>", "<|30.00|>"]) == [50363, 51863]
    assert tok.decode([50363, 50364], decode_with_timestamps=True) == "<|0.00|><|0.02|>"
    # The base parts join into a folder that reads as one model (and a second call reuses it).
    folder = join_parts(WHISPER_BASE, str(tmp_path))
    assert join_parts(WHISPER_BASE, str(tmp_path)) == folder
    assert sorted(os.listdir(folder)) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.json"]
    ct2 = read_ct2_file(os.path.join(folder, "model.bin"))
    assert ct2.get("decoder/embeddings/weight").shape == (51865, 512) and ct2.scalar("encoder/num_heads") == 8
