"""Reading PEFT folders: scaling, the fused layouts, and every refusal with its reason."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.lora.peft_checkpoint import adapter_digest, load_peft_adapter
from pagedllm.lora.target_modules import base_module_shapes, layer_target

from helpers.lora_helpers import make_adapter
from helpers.model_helpers import make_tiny_llama, tiny_llama_config


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("lora_base") / "m")


SHAPES = base_module_shapes(tiny_llama_config())


def _edit_config(path: str, **changes) -> None:
    with open(f"{path}/adapter_config.json") as fh:
        config = json.load(fh)
    config.update(changes)
    with open(f"{path}/adapter_config.json", "w") as fh:
        json.dump(config, fh)


def test_scaling_alpha_over_r_and_rslora(base, tmp_path) -> None:
    plain = make_adapter(base, tmp_path / "plain", r=4, alpha=8, targets=["q_proj"])
    rs = make_adapter(base, tmp_path / "rs", r=4, alpha=8, targets=["q_proj"], use_rslora=True)
    for path, scaling in ((plain, 8 / 4), (rs, 8 / math.sqrt(4))):
        adapter = load_peft_adapter(path, SHAPES, 16)
        raw = load_file(f"{path}/adapter_model.safetensors")
        module = adapter.modules["model.layers.0.self_attn.q_proj"]
        torch.testing.assert_close(module.b, raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
                                   * scaling)
        assert module.rank == 4 and set(adapter.modules) == {f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)}


def test_peft_names_map_onto_the_fused_layers() -> None:
    assert layer_target("model.layers.3.self_attn.k_proj") == ("model.layers.3.self_attn.qkv_proj", 1)
    assert layer_target("model.layers.0.mlp.up_proj") == ("model.layers.0.mlp.gate_up_proj", 1)
    assert layer_target("model.layers.0.mlp.down_proj") == ("model.layers.0.mlp.down_proj", None)


def test_digest_follows_content_not_name(base, tmp_path) -> None:
    a = make_adapter(base, tmp_path / "a", seed=1)
    b = make_adapter(base, tmp_path / "b", seed=1)
    c = make_adapter(base, tmp_path / "c", seed=2)
    assert adapter_digest(a) == adapter_digest(b) != adapter_digest(c)


@pytest.mark.parametrize(("change", "reason"), [
    (dict(use_dora=True), "DoRA"),
    (dict(peft_type="IA3"), "only LoRA adapters"),
    (dict(bias="all"), "bias"),
    (dict(modules_to_save=["lm_head"]), "saves whole modules"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
])
def test_configs_pagedllm_cannot_apply_are_refused(base, tmp_path, change, reason) -> None:
    path = make_adapter(base, tmp_path / "a", targets=["q_proj"])
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=reason):
        load_peft_adapter(path, SHAPES, 16)


def _rewrite_tensors(path: str, fn) -> None:
    tensors = load_file(f"{path}/adapter_model.safetensors")
    save_file(fn(tensors), f"{path}/adapter_model.safetensors")


def test_rank_above_the_limit_is_refused(base, tmp_path) -> None:
    path = make_adapter(base, tmp_path / "a", r=8, targets=["q_proj"])
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        load_peft_adapter(path, SHAPES, 4)


def test_embedding_lora_unknown_modules_and_wrong_shapes_are_refused(base, tmp_path) -> None:
    path = make_adapter(base, tmp_path / "emb", targets=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="embedding or the LM head"):
        load_peft_adapter(path, SHAPES, 16)
    path = make_adapter(base, tmp_path / "other", targets=["q_proj"])
    _rewrite_tensors(path, lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()})
    with pytest.raises(ValueError, match="layers.7.self_attn.q_proj, which the base model does not have"):
        load_peft_adapter(path, SHAPES, 16)
    path = make_adapter(base, tmp_path / "shape", targets=["q_proj"])
    _rewrite_tensors(path, lambda t: {k: torch.cat([v, v], 1) if "lora_A" in k else v for k, v in t.items()})
    with pytest.raises(ValueError, match="do not fit the base model"):
        load_peft_adapter(path, SHAPES, 16)


def test_missing_files_say_what_is_missing(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        load_peft_adapter(str(tmp_path / "nope"), SHAPES, 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_peft_adapter(str(tmp_path / "empty"), SHAPES, 16)
