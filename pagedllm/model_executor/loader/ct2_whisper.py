"""Whisper in CTranslate2's layout (``WhisperSpec``): its folder, its transformers config, its weights by HF name.

A faster-whisper folder holds ``model.bin`` (``loader/ct2_file.py``), ``config.json`` (decoding ids, not
dimensions: ``suppress_ids``, ``suppress_ids_begin``, ``lang_ids``, ``alignment_heads``), ``tokenizer.json``
(the BPE with every special and timestamp token) and ``vocabulary.json`` / ``vocabulary.txt``. The dimensions
come from the variables' shapes and the ``*/num_heads`` attributes.

Variables -> the transformers names they load as (``model.`` prefix; ``S`` is ``encoder`` or ``decoder``, ``i`` a
layer; weights [out, in], biases [out], norms gamma/beta -> weight/bias):

- ``encoder/conv1``, ``encoder/conv2`` (weight [out, in, 3]) -> ``encoder.conv1``, ``encoder.conv2``
- ``encoder/position_encodings/encodings`` [1500, d] (sinusoidal) -> ``encoder.embed_positions.weight``
- ``S/layer_i/self_attention/linear_0`` [3d, d], q|k|v stacked (k bias zeros) -> ``S.layers.i.self_attn.{q,k,v}_proj``
- ``S/layer_i/self_attention/linear_1`` -> ``self_attn.out_proj``; ``.../self_attention/layer_norm`` ->
  ``self_attn_layer_norm``
- ``decoder/layer_i/attention/linear_0`` (cross-attention q) -> ``decoder.layers.i.encoder_attn.q_proj``
- ``decoder/layer_i/attention/linear_1`` [2d, d], k|v stacked -> ``encoder_attn.{k,v}_proj``
- ``decoder/layer_i/attention/linear_2`` -> ``encoder_attn.out_proj``; ``.../attention/layer_norm`` ->
  ``encoder_attn_layer_norm``
- ``S/layer_i/ffn/linear_0``, ``linear_1``, ``layer_norm`` -> ``fc1``, ``fc2``, ``final_layer_norm``
- ``S/layer_norm`` -> ``S.layer_norm``
- ``decoder/embeddings/weight`` -> ``decoder.embed_tokens.weight``; ``decoder/position_encodings/encodings``
  [448, d] (learned) -> ``decoder.embed_positions.weight``
- ``decoder/projection/weight`` (an alias of the embeddings) -> ``proj_out`` (tied)

transformers' k projections have no bias: CTranslate2's zero k biases are dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.model_executor.loader.ct2_file import CT2File, read_ct2_file

WHISPER_SPEC = "WhisperSpec"
# OpenAI's decoding default (whisper/decoding.py: max_initial_timestamp = 1.0 s, 0.02 s a step).
MAX_INITIAL_TIMESTAMP_INDEX = 50


def _added_tokens(folder: str) -> list[dict]:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: {folder} has no tokenizer.json (a Whisper CTranslate2 folder ships one)")
    with open(path) as f:
        return json.load(f).get("added_tokens", [])


def _special_ids(folder: str) -> dict[str, int]:
    """Added token -> id, from the folder's ``tokenizer.json`` (special ones, and timestamps where present)."""
    return {t["content"]: int(t["id"]) for t in _added_tokens(folder)}


def whisper_special_tokens(folder: str) -> list[str]:
    """The special added tokens (``<|endoftext|>`` ... ``<|notimestamps|>``), in id order: the tokenizer must be
    told them all, or transformers puts ``<|0.00|>`` after the wrong id when it decodes timestamps."""
    special = sorted((t for t in _added_tokens(folder) if t.get("special")), key=lambda t: int(t["id"]))
    return [t["content"] for t in special]


def timestamp_tokens() -> list[str]:
    """``<|0.00|>`` ... ``<|30.00|>``: 1501 tokens, 0.02 s apart, right after ``<|notimestamps|>``."""
    return [f"<|{i * 0.02:.2f}|>" for i in range(1501)]


def _count_layers(ct2: CT2File, side: str) -> int:
    n = 0
    while ct2.has(f"{side}/layer_{n}/ffn/linear_0/weight"):
        n += 1
    return n


def ct2_whisper_config(folder: str, ct2: CT2File | None = None) -> Any:
    """A transformers ``WhisperConfig`` for a CTranslate2 Whisper folder, with its decoding ids (suppress
    lists, ``<|notimestamps|>``, languages) as attributes the engine reads."""
    from transformers import WhisperConfig

    ct2 = ct2 or read_ct2_file(os.path.join(folder, "model.bin"))
    if ct2.spec != WHISPER_SPEC:
        raise ValueError(f"model: {ct2.path} holds a CTranslate2 {ct2.spec!r}; only {WHISPER_SPEC} is supported")
    with open(os.path.join(folder, "config.json")) as f:
        ct2_config = json.load(f)
    special = _special_ids(folder)
    vocab, d_model = ct2.get("decoder/embeddings/weight").shape
    eos = special["<|endoftext|>"]
    multilingual = int(vocab) >= 51865  # English-only models (.en) have one token less and no language tokens used
    languages = {t: i for t, i in special.items() if i in set(ct2_config.get("lang_ids", []))} if multilingual else {}
    tasks = {t: special[f"<|{t}|>"] for t in ("transcribe", "translate") if f"<|{t}|>" in special} if multilingual \
        else {}
    return WhisperConfig(
        architectures=["WhisperForConditionalGeneration"],
        vocab_size=int(vocab), d_model=int(d_model), num_mel_bins=int(ct2.get("encoder/conv1/weight").shape[1]),
        encoder_layers=_count_layers(ct2, "encoder"), decoder_layers=_count_layers(ct2, "decoder"),
        encoder_attention_heads=ct2.scalar("encoder/num_heads"),
        decoder_attention_heads=ct2.scalar("decoder/num_heads"),
        encoder_ffn_dim=int(ct2.get("encoder/layer_0/ffn/linear_0/weight").shape[0]),
        decoder_ffn_dim=int(ct2.get("decoder/layer_0/ffn/linear_0/weight").shape[0]),
        max_source_positions=int(ct2.get("encoder/position_encodings/encodings").shape[0]),
        max_target_positions=int(ct2.get("decoder/position_encodings/encodings").shape[0]),
        activation_function="gelu", scale_embedding=False, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        decoder_start_token_id=special["<|startoftranscript|>"],
        suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [])),
        no_timestamps_token_id=special.get("<|notimestamps|>"),
        max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX,
        lang_to_id=languages, task_to_id=tasks, is_multilingual=multilingual,
    )



def whisper_generation_config(hf_config: Any) -> Any:
    """transformers' ``GenerationConfig`` for the decoding ids resolved onto ``hf_config`` (by
    ``ct2_whisper_config``): what transformers' ``generate`` needs to decode like the engine (the references of the
    tests and of ``benchmarks/whisper_peers.py``)."""
    from transformers import GenerationConfig

    multilingual = bool(getattr(hf_config, "is_multilingual", False))
    # An English-only model's config must not have lang_to_id at all: transformers detects a language if it does.
    languages = dict(lang_to_id=dict(hf_config.lang_to_id), task_to_id=dict(hf_config.task_to_id)) if multilingual \
        else {}
    return GenerationConfig(
        decoder_start_token_id=hf_config.decoder_start_token_id, eos_token_id=hf_config.eos_token_id,
        pad_token_id=hf_config.eos_token_id, bos_token_id=hf_config.eos_token_id,
        suppress_tokens=list(hf_config.suppress_tokens), begin_suppress_tokens=list(hf_config.begin_suppress_tokens),
        no_timestamps_token_id=hf_config.no_timestamps_token_id,
        max_initial_timestamp_index=hf_config.max_initial_timestamp_index, is_multilingual=multilingual,
        max_length=448, **languages)

def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: the mapped file is read-only


def _linear(ct2: CT2File, src: str, dst: str, rows: tuple[str, ...] | None = None,
            drop_bias: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """``src``'s weight and bias under ``dst``, split by rows into the names of ``rows`` when it is stacked."""
    weight, bias = _tensor(ct2.get(f"{src}/weight")), _tensor(ct2.get(f"{src}/bias"))
    if rows is None:
        yield f"{dst}.weight", weight
        yield f"{dst}.bias", bias
        return
    for part, w, b in zip(rows, weight.chunk(len(rows)), bias.chunk(len(rows)), strict=True):
        yield f"{dst}.{part}.weight", w
        if part not in drop_bias:
            yield f"{dst}.{part}.bias", b


def _norm(ct2: CT2File, src: str, dst: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{dst}.weight", _tensor(ct2.get(f"{src}/gamma"))
    yield f"{dst}.bias", _tensor(ct2.get(f"{src}/beta"))


def iter_ct2_whisper_weights(ct2: CT2File, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, float32 tensor) for every weight of a CTranslate2 Whisper model (table above)."""
    qkv, kv = ("q_proj", "k_proj", "v_proj"), ("k_proj", "v_proj")
    for conv in ("conv1", "conv2"):
        yield from _linear(ct2, f"encoder/{conv}", f"model.encoder.{conv}")
    yield "model.encoder.embed_positions.weight", _tensor(ct2.get("encoder/position_encodings/encodings"))
    yield "model.decoder.embed_tokens.weight", _tensor(ct2.get("decoder/embeddings/weight"))
    yield "model.decoder.embed_positions.weight", _tensor(ct2.get("decoder/position_encodings/encodings"))
    for side, num_layers in (("encoder", hf_config.encoder_layers), ("decoder", hf_config.decoder_layers)):
        for i in range(num_layers):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            yield from _linear(ct2, f"{src}/self_attention/linear_0", f"{dst}.self_attn", qkv, ("k_proj",))
            yield from _linear(ct2, f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            yield from _norm(ct2, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            if side == "decoder":
                yield from _linear(ct2, f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                yield from _linear(ct2, f"{src}/attention/linear_1", f"{dst}.encoder_attn", kv, ("k_proj",))
                yield from _linear(ct2, f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
                yield from _norm(ct2, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
            yield from _linear(ct2, f"{src}/ffn/linear_0", f"{dst}.fc1")
            yield from _linear(ct2, f"{src}/ffn/linear_1", f"{dst}.fc2")
            yield from _norm(ct2, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
        yield from _norm(ct2, f"{side}/layer_norm", f"model.{side}.layer_norm")


def count_ct2_whisper_weights(hf_config: Any) -> int:
    """How many tensors ``iter_ct2_whisper_weights`` yields (for the progress bar)."""
    per_layer = 5 + 2 + 2 + 2 + 2 + 2  # q/k/v (k without bias), out, norm, fc1, fc2, final norm
    cross = 2 + 3 + 2 + 2  # q, k/v (k without bias), out, norm
    return 4 + 1 + 2 + 4 + (hf_config.encoder_layers + hf_config.decoder_layers) * per_layer \
        + hf_config.decoder_layers * cross
