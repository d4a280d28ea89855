"""`pagedllm models` and the /v1/models metadata list the supported architectures."""

from __future__ import annotations

import json

from pagedllm.entrypoints.cli.main import main
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.model_executor.models.registry import get_model_cls, supported_architectures

EXPECTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
            "Gemma3ForCausalLM", "GPT2LMHeadModel", "BertModel", "WhisperForConditionalGeneration",
            "LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration", "Gemma3ForConditionalGeneration", "LlavaNextForConditionalGeneration",
            "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
            "OlmoeForCausalLM", "GraniteMoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
            "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Dots1ForCausalLM",
            "Glm4MoeLiteForCausalLM"}


def test_cli_lists_every_architecture(capsys) -> None:
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {a["architecture"] for a in listed} == EXPECTED
    assert next(a for a in listed if a["architecture"] == "Gemma3ForCausalLM")["formats"] == ["hf", "gguf"]
    by_name = {a["architecture"]: a for a in listed}
    assert by_name["LlavaForConditionalGeneration"]["inputs"] == ["text", "image"]
    assert by_name["LlamaForCausalLM"]["inputs"] == ["text"]
    gguf_archs = {a["gguf_architecture"] for a in listed if "gguf" in a["formats"]}
    assert gguf_archs == {"llama", "qwen2", "qwen3", "phi3", "gemma3", "gpt2", "qwen2moe", "qwen3moe"}
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "GGUF (qwen3)" in out and "GGUF (phi3)" in out
    assert "text+image" in out


def test_every_listed_architecture_has_a_class() -> None:
    for arch in supported_architectures():
        assert get_model_cls([arch]).__name__.endswith(("ForCausalLM", "LMHeadModel", "Model",
                                                        "ForConditionalGeneration"))


def test_v1_models_metadata() -> None:
    body = ServingModels(["m"], "/x", 128, "Gemma3ForCausalLM").list().model_dump()
    assert body["data"][0]["architecture"] == "Gemma3ForCausalLM"
    assert set(body["supported_architectures"]) == EXPECTED
    assert body["architecture_formats"]["Phi3ForCausalLM"] == ["hf", "gguf"]
    assert body["architecture_formats"]["BertModel"] == ["hf"]


def test_gguf_architectures_match_the_registry() -> None:
    """Every GGUF architecture the loader reads is listed under a registry entry, and vice versa."""
    from pagedllm.model_executor.loader.gguf_llama import supported_gguf_architectures
    from pagedllm.model_executor.models.registry import architecture_infos

    assert {a.gguf_arch for a in architecture_infos() if "gguf" in a.formats} == set(supported_gguf_architectures())


def test_listing_names_the_implementation_and_the_fallback(capsys, monkeypatch) -> None:
    assert main(["models", "--json"]) == 0
    assert {a["model_impl"] for a in json.loads(capsys.readouterr().out)} == {"pagedllm"}
    assert main(["models"]) == 0
    assert "transformers fallback" in capsys.readouterr().out
    # --fallback over a short list of transformers' causal LMs (the whole list imports every class)
    import transformers.models.auto.modeling_auto as auto

    monkeypatch.setattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                        {"olmo2": "Olmo2ForCausalLM", "stablelm": "StableLmForCausalLM", "llama": "LlamaForCausalLM"})
    assert main(["models", "--fallback", "--json"]) == 0
    rows = {a["architecture"]: a for a in json.loads(capsys.readouterr().out)}
    assert rows["LlamaForCausalLM"]["model_impl"] == "pagedllm"  # native: listed once, as native
    assert rows["Olmo2ForCausalLM"]["model_impl"] == "transformers"
    assert rows["StableLmForCausalLM"]["model_impl"] is None
    assert main(["models", "--fallback"]) == 0
    out = capsys.readouterr().out
    assert "Olmo2ForCausalLM" in out and "no (no attention-interface support)" in out
