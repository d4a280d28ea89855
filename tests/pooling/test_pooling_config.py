"""Runner detection and pooling settings read from sentence-transformers files (no model loaded)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedllm.config import PoolerConfig
from pagedllm.model_executor.loader.pooling_config import (
    resolve_pooler_config,
    resolve_runner,
    sentence_transformers_max_len,
)


def _st_folder(tmp_path, mode: str | None, normalize: bool, max_len: int | None = None):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, mode: True}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if max_len:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len}))
    return str(tmp_path)


CFG = SimpleNamespace(hidden_size=8)


@pytest.mark.parametrize(("mode", "expected"), [("pooling_mode_mean_tokens", "MEAN"),
                                                ("pooling_mode_cls_token", "CLS"),
                                                ("pooling_mode_lasttoken", "LAST")])
def test_pooling_mode_from_st_files(tmp_path, mode, expected):
    folder = _st_folder(tmp_path, mode, normalize=False, max_len=128)
    cfg = resolve_pooler_config(folder, CFG, "CLS", None)
    assert (cfg.pooling_type, cfg.normalize, cfg.enable_matryoshka) == (expected, False, False)
    assert sentence_transformers_max_len(folder) == 128


def test_normalize_module_and_overrides(tmp_path):
    folder = _st_folder(tmp_path, "pooling_mode_cls_token", normalize=True)
    assert resolve_pooler_config(folder, CFG, "LAST", None).normalize is True
    cfg = resolve_pooler_config(folder, CFG, "LAST", PoolerConfig(pooling_type="mean", normalize=False))
    assert (cfg.pooling_type, cfg.normalize) == ("MEAN", False)
    with pytest.raises(ValueError, match="pooling_type"):
        resolve_pooler_config(folder, CFG, "LAST", PoolerConfig(pooling_type="max"))


def test_unsupported_st_pooling_is_named(tmp_path):
    folder = _st_folder(tmp_path, "pooling_mode_max_tokens", normalize=True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        resolve_pooler_config(folder, CFG, "CLS", None)


def test_defaults_without_st_files_and_matryoshka_from_config(tmp_path):
    cfg = resolve_pooler_config(str(tmp_path), SimpleNamespace(matryoshka_dimensions=[4, 8]), "LAST", None)
    assert (cfg.pooling_type, cfg.normalize, cfg.enable_matryoshka) == ("LAST", True, True)
    assert sentence_transformers_max_len(str(tmp_path)) is None


def test_runner_detection(tmp_path):
    assert resolve_runner("auto", True, None, "BertModel") == "pooling"
    assert resolve_runner("auto", False, str(tmp_path), "LlamaForCausalLM") == "generate"
    st = _st_folder(tmp_path, "pooling_mode_lasttoken", normalize=True)
    assert resolve_runner("auto", False, st, "LlamaForCausalLM") == "pooling"  # an ST-packaged decoder embedder
    assert resolve_runner("pooling", False, None, "LlamaForCausalLM") == "pooling"
    with pytest.raises(ValueError, match="encoder-only"):
        resolve_runner("generate", True, None, "BertModel")
    with pytest.raises(ValueError, match="runner: must be one of"):
        resolve_runner("embed", False, None, "LlamaForCausalLM")
