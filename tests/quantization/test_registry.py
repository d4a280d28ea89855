"""The scheme registry: ``--quantization`` names and checkpoint formats looked up in one table that each config
class joins with ``register_quantization_config``."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from pagedllm.model_executor.layers.quantization import (
    CHECKPOINT_FORMATS,
    QUANTIZATION_METHODS,
    QuantizationConfig,
    get_quantization_config,
    register_quantization_config,
    registry,
)
from pagedllm.model_executor.layers.quantization.fp8 import Fp8Config
from pagedllm.model_executor.layers.quantization.gguf import GGUFConfig
from pagedllm.model_executor.layers.quantization.gptq_awq import AWQConfig, GPTQConfig
from pagedllm.model_executor.layers.quantization.weight_only import Int4Config, Int8Config, W8A8Config


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test end with it."""
    monkeypatch.setattr(registry, "_CONFIGS", dict(registry.quantization_configs()))


def _checkpoint(**cfg: Any) -> Any:
    return type("HfConfig", (), {"quantization_config": cfg})()


def test_the_registry_serves_the_documented_names() -> None:
    configs = registry.quantization_configs()
    assert set(configs) == set(QUANTIZATION_METHODS) - {"none"}
    assert {name for name, cls in configs.items() if cls.reads_checkpoints} == set(CHECKPOINT_FORMATS)
    assert configs["int8"] is Int8Config and configs["w8a8"] is W8A8Config and configs["fp8"] is Fp8Config
    assert configs["int4"] is configs["int4-g64"] is configs["int4-g128"] is Int4Config
    assert configs["gguf"] is GGUFConfig and configs["gptq"] is GPTQConfig and configs["awq"] is AWQConfig


def test_names_build_their_configs() -> None:
    assert [get_quantization_config(m).group for m in ("int4", "int4-g64", "int4-g128")] == [32, 64, 128]
    assert isinstance(get_quantization_config("gguf", gguf_file="model.gguf"), GGUFConfig)
    assert get_quantization_config("none") is None and get_quantization_config("") is None
    with pytest.raises(ValueError, match="reads checkpoints whose config.json"):
        get_quantization_config("gptq")
    gptq = get_quantization_config(None, _checkpoint(quant_method="gptq", bits=8, group_size=64))
    assert isinstance(gptq, GPTQConfig) and (gptq.bits, gptq.group_size) == (8, 64)
    assert get_quantization_config("fp8", _checkpoint(quant_method="fp8")).checkpoint


def test_a_scheme_that_is_not_a_checkpoint_format_is_refused_from_config_json() -> None:
    with pytest.raises(ValueError, match="'int8'.*supported checkpoint formats: gptq, awq, fp8"):
        get_quantization_config(None, _checkpoint(quant_method="int8"))


@pytest.mark.usefixtures("scratch_registry")
def test_a_registered_scheme_is_found_by_flag_and_by_checkpoint() -> None:
    @register_quantization_config("toy", "toy-ckpt")
    class ToyConfig(QuantizationConfig):
        name = "toy"
        reads_checkpoints = True

        def __init__(self, source: str) -> None:
            self.source = source

        @classmethod
        def from_flag(cls, method: str, gguf_file: str | None = None) -> ToyConfig:
            return cls(f"flag {method}")

        @classmethod
        def from_hf(cls, cfg: dict[str, Any]) -> ToyConfig:
            return cls(f"checkpoint {cfg['quant_method']}")

        def get_linear_method(self, layer: nn.Module, prefix: str) -> Any:
            raise NotImplementedError

    assert get_quantization_config("toy-ckpt").source == "flag toy-ckpt"
    assert get_quantization_config(None, _checkpoint(quant_method="toy")).source == "checkpoint toy"


@pytest.mark.usefixtures("scratch_registry")
def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'int8' is already registered by Int8Config"):
        register_quantization_config("int8")(type("Other", (QuantizationConfig,), {}))
    assert register_quantization_config("int8")(Int8Config) is Int8Config  # the same class again is harmless
