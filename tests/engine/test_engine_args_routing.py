"""The flags of cross-process prefix routing reach the config: the hash algorithm (and, later, KV events)."""

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
