"""What neither the native code nor the transformers fallback can run gets an error naming the architecture and
the reason; what the fallback cannot give is refused; --trust-remote-code runs a folder's own modeling code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.engine_args import EngineArgs
from pagedllm.model_executor.loader import resolve_model_config

from helpers.arch_configs import hf_model, save_tiny, save_word_tokenizer, tiny_config
from helpers.fallback_configs import fallback_config, save_fallback_tiny

ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_fallback_tiny("Olmo2ForCausalLM", tmp_path_factory.mktemp("olmo2"))[0]


def _save(config, path: Path) -> str:
    hf_model(config).save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path)


def test_a_class_without_the_attention_interface_is_named(tmp_path: Path) -> None:
    import transformers as tf

    path = _save(tf.StableLmConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, architectures=["StableLmForCausalLM"]),
                 tmp_path)
    with pytest.raises(ValueError, match=r"StableLmForCausalLM cannot run.*does not support the attention interface"):
        resolve_model_config(ModelConfig(model=path))


def test_an_unknown_model_type_is_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model",
                                                      "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError, match=r"NoSuchForCausalLM cannot run.*'no_such_model' is unknown to transformers"):
        resolve_model_config(ModelConfig(model=str(tmp_path)))


def test_native_only_refuses_a_fallback_architecture(olmo2: str) -> None:
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM.*not supported"):
        resolve_model_config(ModelConfig(model=olmo2, model_impl="pagedllm"))
    with pytest.raises(ValueError, match="model_impl: must be one of"):
        resolve_model_config(ModelConfig(model=olmo2, model_impl="vllm"))


@pytest.mark.parametrize(("overrides", "match"), [
    ({"quantization": "int8"}, r"quantization: --quantization int8 is not supported through the transformers"),
    ({"tensor_parallel_size": 2}, r"tensor_parallel_size: Olmo2ForCausalLM runs through the transformers fallback"),
    ({"speculative_config": {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 2}},
     r"layer_skip.*transformers fallback"),
])
def test_what_the_fallback_cannot_give_is_refused(olmo2: str, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=olmo2, **overrides).create_engine_config()


def test_chunked_attention_is_refused(tmp_path: Path) -> None:
    config = fallback_config("Olmo2ForCausalLM")
    config.attention_chunk_size = 8  # a mask transformers would build from the config, pagedllm's backends not
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM cannot run.*chunked attention"):
        resolve_model_config(ModelConfig(model=_save(config, tmp_path)))


def test_attention_soft_capping_is_refused_at_load(tmp_path: Path) -> None:
    config = fallback_config("Gemma2ForCausalLM")
    config.attn_logit_softcapping = 50.0
    path = _save(config, tmp_path)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM through the transformers fallback: layer 0 uses "
                                         r"attention logit soft-capping"):
        LLM(model=path, **ENGINE)


_CONFIG_CODE = """from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""
_MODELING_CODE = """from transformers import LlamaForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


@pytest.fixture(scope="module")
def remote_code_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Llama-shaped model whose folder ships its own config and modeling code (config.json's auto_map)."""
    path = tmp_path_factory.mktemp("tiny_remote")
    save_tiny("LlamaForCausalLM", path)
    (path / "configuration_tiny_remote.py").write_text(_CONFIG_CODE)
    (path / "modeling_tiny_remote.py").write_text(_MODELING_CODE)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_remote_code_needs_trust_remote_code(remote_code_folder: str) -> None:
    with pytest.raises(ValueError, match=r"TinyRemoteForCausalLM cannot run.*pass --trust-remote-code"):
        resolve_model_config(ModelConfig(model=remote_code_folder))


def test_remote_code_runs_with_trust_remote_code(remote_code_folder: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(remote_code_folder, trust_remote_code=True, dtype=torch.float32)
    assert type(hf).__name__ == "TinyRemoteForCausalLM"
    prompt = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(model=remote_code_folder, trust_remote_code=True, **ENGINE)
    try:
        assert llm.engine.config.model.model_impl == "transformers"
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
    finally:
        llm.engine.core.close()


def test_native_architectures_stay_native(tmp_path: Path) -> None:
    path = _save(tiny_config("Qwen3ForCausalLM"), tmp_path)
    assert resolve_model_config(ModelConfig(model=path)).model_impl == "pagedllm"


def test_a_remote_code_config_reaches_an_engine_process(remote_code_folder: str, tmp_path: Path) -> None:
    """Engine processes are spawned: they unpickle the config before they could import the folder's code."""
    import os
    import pickle
    import subprocess
    import sys

    mc = resolve_model_config(ModelConfig(model=remote_code_folder, trust_remote_code=True))
    (tmp_path / "mc.pkl").write_bytes(pickle.dumps(mc))
    code = ("import pickle, sys; mc = pickle.load(open(sys.argv[1], 'rb')); "
            "print(type(mc.hf_config).__name__, mc.hf_config.hidden_size, mc.model_impl)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "mc.pkl")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.split() == ["TinyRemoteConfig", "64", "transformers"], out.stderr[-2000:]


def test_extra_checkpoint_tensors_are_left_out_and_missing_ones_refused(olmo2: str, tmp_path: Path, caplog) -> None:
    """As transformers does: a tensor no parameter takes is logged and skipped; a parameter nobody fills fails."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(olmo2) / "model.safetensors"))
    extra, short = tmp_path / "extra", tmp_path / "short"
    for folder, changed in ((extra, {**tensors, "model.layers.0.self_attn.masked_bias": torch.zeros(1)}),
                            (short, {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k})):
        shutil.copytree(olmo2, folder)
        save_file(changed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(model=str(extra), **ENGINE)
    llm.engine.core.close()
    assert "1 checkpoint tensors match no parameter" in caplog.text and "masked_bias" in caplog.text
    with pytest.raises(ValueError, match=r"weights missing from the checkpoint: \['model.layers.1.mlp.up_proj"):
        LLM(model=str(short), **ENGINE)
