"""The flags of cross-process prefix routing reach the config: the block hash algorithm and the KV events."""

import argparse

import pytest

from pagedllm.engine_args import EngineArgs


def _parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_hash_algo_defaults_to_builtin_and_sha256_reaches_the_cache_config() -> None:
    assert _parse([]).prefix_caching_hash_algo == "builtin"
    args = _parse(["--prefix-caching-hash-algo", "sha256", "--prefix-caching-hash-seed", "3"])
    config = args.create_engine_config()
    assert config.cache.prefix_caching_hash_algo == "sha256" and config.cache.prefix_caching_hash_seed == 3


def test_unknown_hash_algo_is_rejected() -> None:
    with pytest.raises(SystemExit):
        _parse(["--prefix-caching-hash-algo", "md5"])
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineArgs(prefix_caching_hash_algo="md5").create_engine_config()


def test_kv_events_config_reaches_the_engine_config() -> None:
    assert _parse([]).create_engine_config().kv_events is None
    config = _parse(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}']).create_engine_config()
    assert config.kv_events.publishes and config.kv_events.topic == "t"
    assert config.kv_events.endpoint == "tcp://127.0.0.1:5557"  # loopback unless told otherwise


@pytest.mark.parametrize("raw, field", [("{oops", "kv_events_config"), ('{"topics": "t"}', "unknown key"),
                                        ('{"replay_endpoint": "tcp://127.0.0.1:1"}', "replay_endpoint")])
def test_bad_kv_events_config_names_the_field(raw: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineArgs(kv_events_config=raw).create_engine_config()
