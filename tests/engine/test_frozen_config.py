"""The config is frozen: nothing writes to it after it is built. What start-up resolves (the device, the KV
blocks, the windows) is a ``KVCacheLayout`` handed on, and a config that carries it is a new object."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVCacheLayout,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.core.encoder_decoder import configure_encoder_decoder
from pagedllm.engine.core_messages import Ready
from pagedllm.engine.dp_router import DataParallelRouter
from pagedllm.engine.mp_engine import layout_from_ready

from helpers.arch_configs import save_tiny


def _config(device: str = "auto", **parallel: object) -> EngineConfig:
    return EngineConfig(model=ModelConfig(), cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(),
                        device=DeviceConfig(device=device), parallel=ParallelConfig(**parallel))


@pytest.mark.parametrize(("part", "field", "value"), [
    ("cache", "num_blocks", 10), ("cache", "sliding_window", 64), ("cache", "enable_prefix_caching", False),
    ("scheduler", "max_model_len", 9), ("scheduler", "num_lookahead_tokens", 3),
    ("device", "device", "cpu"), ("device", "enforce_eager", True),
    ("parallel", "tensor_parallel_size", 2),
])
def test_writing_to_a_config_raises(part: str, field: str, value: object) -> None:
    config = _config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(getattr(config, part), field, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kv_events = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVCacheLayout(num_blocks=8).num_blocks = 9


def test_a_layout_resolves_a_copy_and_leaves_the_config_alone() -> None:
    config = _config()
    layout = KVCacheLayout(num_blocks=40, device="cpu", sliding_window=None, sliding_group_window=16,
                           sliding_group_num_blocks=12, cross_group_num_blocks=0)
    resolved = config.with_kv_cache_layout(layout)
    assert resolved is not config and resolved.cache is not config.cache
    assert not config.cache.is_resolved and config.cache.num_blocks == 0 and config.device.device == "auto"
    assert resolved.cache.is_resolved and resolved.cache.num_blocks == 40 and resolved.device.device == "cpu"
    assert resolved.cache.sliding_group() == (12, 16)
    assert resolved.cache.block_size == 4 and resolved.scheduler is config.scheduler and resolved.model is config.model


def test_the_api_side_layout_takes_the_fewest_blocks_of_all_engines() -> None:
    ready = [Ready(0, 100, 256, sliding_window=32, device="cuda", cross_group_num_blocks=5), Ready(1, 80, 256)]
    layout = layout_from_ready(ready)
    assert layout == KVCacheLayout(num_blocks=80, device="cuda", sliding_window=32, cross_group_num_blocks=5)


def test_encoder_decoder_settings_are_new_objects() -> None:
    model = ModelConfig(architecture="WhisperForConditionalGeneration", is_encoder_decoder=True,
                        hf_config=SimpleNamespace(max_source_positions=1500))
    cache, scheduler = CacheConfig(), SchedulerConfig()
    new_cache, new_scheduler = configure_encoder_decoder(model, cache, scheduler)
    assert cache.enable_prefix_caching and cache.cross_group_tokens == 0 and scheduler.encoder_tokens_per_request == 0
    assert not new_cache.enable_prefix_caching and new_cache.cross_group_tokens == 1500
    assert new_scheduler.encoder_tokens_per_request == 1500
    assert configure_encoder_decoder(ModelConfig(), cache, scheduler) == (cache, scheduler)


def test_the_router_hands_the_engines_a_copy() -> None:
    config = _config(data_parallel_size=2)
    router = DataParallelRouter(config, 2)
    try:
        assert config.cache.prefix_caching_hash_algo == "builtin" and config.kv_events is None
        assert router.config.cache.prefix_caching_hash_algo == "sha256" and router.config.kv_events is not None
    finally:
        router.close()


def test_tensor_parallel_turns_graphs_off_in_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedllm.platforms
    import pagedllm.worker.worker  # noqa: F401  (imported before the patch: it binds the real platform_for)
    from pagedllm.executor import eager_across_ranks

    # A named device: "auto" would ask the stand-in platform whether CUDA is there.
    config = _config("cpu", tensor_parallel_size=2)
    monkeypatch.setattr(pagedllm.platforms, "platform_for", lambda device: SimpleNamespace(supports_graphs=True))
    eager = eager_across_ranks(config)
    assert eager.device.enforce_eager and not config.device.enforce_eager
    assert eager_across_ranks(_config("cpu")) == _config("cpu")  # one rank: unchanged
    monkeypatch.setattr(pagedllm.platforms, "platform_for", lambda device: SimpleNamespace(supports_graphs=False))
    assert eager_across_ranks(config) is config


def test_an_engine_resolves_a_copy_of_its_config(tmp_path) -> None:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_args import EngineArgs

    config = EngineArgs(model=save_tiny("LlamaForCausalLM", tmp_path / "m")[0], dtype="float32", kv_cache_memory="4MiB",
                        max_model_len=128, enforce_eager=True).create_engine_config()
    assert dataclasses.is_dataclass(config) and not config.cache.is_resolved
    engine = LLMEngine(config)
    layout = engine.core.kv_cache_layout
    assert layout.num_blocks > 2 and layout.device == "cpu"
    assert config.cache.num_blocks == 0 and config.device.device == "auto"  # the given config is never written
    for resolved in (engine.config, engine.core.config, engine.core.worker.config):
        assert resolved.cache.num_blocks == layout.num_blocks and resolved.device.device == "cpu"
    assert engine.core.scheduler.kv.pool.num_blocks == layout.num_blocks
