"""--kv-transfer-config: vLLM's keys, errors that name the key, and what a connector changes in the engine config."""

from __future__ import annotations

import pytest

from pagedllm.distributed.kv_transfer.config import parse_kv_transfer_config
from pagedllm.engine_args import EngineArgs


def test_defaults_and_roles() -> None:
    cfg = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}')
    assert cfg.kv_ip == "127.0.0.1" and cfg.kv_port is None and cfg.engine_id
    assert cfg.is_kv_consumer and not cfg.is_kv_producer
    both = parse_kv_transfer_config({"kv_connector": "SharedStorageConnector"})
    assert both.is_kv_consumer and both.is_kv_producer
    assert parse_kv_transfer_config(None) is None
    assert parse_kv_transfer_config({"kv_connector": "NixlConnector", "engine_id": "a"}).engine_id == "a"


@pytest.mark.parametrize("raw, key", [
    ('{"kv_connector": "Nope"}', "kv_connector"),
    ({"kv_connector": "NixlConnector", "kv_role": "prefill"}, "kv_role"),
    ({"kv_connector": "NixlConnector", "kv_ip": "not-an-ip"}, "kv_ip"),
    ({"kv_connector": "NixlConnector", "kv_port": 70000}, "kv_port"),
    ({"kv_connector": "NixlConnector", "kv_rank": -1}, "kv_rank"),
    ({"kv_connector": "NixlConnector", "kv_parallel_size": 0}, "kv_parallel_size"),
    ({"kv_connector": "NixlConnector", "kv_connector_extra_config": []}, "kv_connector_extra_config"),
    ({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"abort_request_timeout": 0}},
     "abort_request_timeout"),
    ({"kv_connector": "MultiConnector"}, "connectors"),
    ({"kv_connector": "NixlConnector", "bogus": 1}, "bogus"),
    ("{not json", "kv_transfer_config"),
])
def test_errors_name_the_key(raw, key) -> None:
    with pytest.raises(ValueError, match=key):
        parse_kv_transfer_config(raw)


@pytest.mark.slow  # resolves the default model's config
def test_a_connector_makes_sha256_the_default_hash(tmp_path) -> None:
    args = EngineArgs(kv_transfer_config={"kv_connector": "SharedStorageConnector",
                                          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    config = args.create_engine_config()
    assert config.cache.prefix_caching_hash_algo == "sha256"
    assert config.kv_transfer.kv_connector == "SharedStorageConnector"
    assert EngineArgs().create_engine_config().cache.prefix_caching_hash_algo == "builtin"
    with pytest.raises(ValueError, match="kv_transfer_config"):
        EngineArgs(kv_transfer_config={"kv_connector": "NixlConnector"}, data_parallel_size=2).create_engine_config()
