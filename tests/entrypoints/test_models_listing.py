"""`pagedllm models` and the /v1/models metadata list the supported architectures."""

from __future__ import annotations

import json

from pagedllm.entrypoints.cli.main import main
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.model_executor.models.registry import get_model_cls, supported_architectures

EXPECTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
            "Gemma3ForCausalLM", "GPT2LMHeadModel", "BertModel"}


def test_cli_lists_every_architecture(capsys) -> None:
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {a["architecture"] for a in listed} == EXPECTED
    assert next(a for a in listed if a["architecture"] == "Gemma3ForCausalLM")["formats"] == ["hf", "gguf"]
    assert main(["models"]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out


def test_every_listed_architecture_has_a_class() -> None:
    for arch in supported_architectures():
        assert get_model_cls([arch]).__name__.endswith(("ForCausalLM", "LMHeadModel", "Model"))


def test_v1_models_metadata() -> None:
    body = ServingModels(["m"], "/x", 128, "Gemma3ForCausalLM").list().model_dump()
    assert body["data"][0]["architecture"] == "Gemma3ForCausalLM"
    assert set(body["supported_architectures"]) == EXPECTED
