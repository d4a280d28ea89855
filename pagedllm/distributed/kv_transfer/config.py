"""``--kv-transfer-config``: vLLM's keys checked into a ``KVTransferConfig``. No torch, no zmq here."""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedllm.utils import parse_json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("SharedStorageConnector", "NixlConnector", "MultiConnector")
_KNOWN_KEYS = {"kv_connector", "kv_role", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "engine_id",
               "kv_connector_extra_config", "kv_buffer_device"}
# A producer frees blocks no consumer read after this long (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
DEFAULT_SEND_TIMEOUT_S = 180.0


@dataclass
class KVTransferConfig:
    """Which connector an instance runs and its role.

    ``kv_role``: ``kv_producer`` (a prefill instance: computes prompts, holds their blocks for a reader),
    ``kv_consumer`` (a decode instance: receives a prompt's blocks), ``kv_both``. ``kv_ip`` / ``kv_port``: where
    the connector's side channel listens (loopback by default; no port: ``VLLM_NIXL_SIDE_CHANNEL_PORT``, else a
    free port picked at start-up). ``engine_id`` names the instance to its peers (random unless given).
    ``kv_connector_extra_config``: the connector's own keys (``docs/disaggregation.md``).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int | None = None
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @property
    def send_timeout_s(self) -> float:
        """Seconds a producer holds blocks that no consumer has read (``abort_request_timeout``)."""
        return float(self.get_from_extra_config("abort_request_timeout", DEFAULT_SEND_TIMEOUT_S))


def _int(raw: dict, key: str, default: Any, low: int, high: int | None = None) -> Any:
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"kv_transfer_config.{key}: must be an integer {bound}, got {value!r}")
    return value


def parse_kv_transfer_config(raw: str | dict[str, Any] | KVTransferConfig | None) -> KVTransferConfig | None:
    """A JSON string or dict with vLLM's keys → KVTransferConfig (None stays None); ValueError naming the key."""
    if raw is None or isinstance(raw, KVTransferConfig):
        return raw
    raw = parse_json_object(raw, "kv_transfer_config", _KNOWN_KEYS)
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector: must be one of {list(CONNECTORS)}, got {connector!r}")
    role = raw.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"kv_transfer_config.kv_role: must be one of {list(KV_ROLES)}, got {role!r}")
    kv_ip = raw.get("kv_ip", "127.0.0.1")
    try:
        ipaddress.ip_address(kv_ip)
    except (TypeError, ValueError):
        raise ValueError(f"kv_transfer_config.kv_ip: must be an IP address, got {kv_ip!r}") from None
    engine_id = raw.get("engine_id") or uuid.uuid4().hex
    if not isinstance(engine_id, str):
        raise ValueError(f"kv_transfer_config.engine_id: must be a string, got {engine_id!r}")
    extra = raw.get("kv_connector_extra_config")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config: must be a JSON object, got {extra!r}")
    timeout = extra.get("abort_request_timeout", DEFAULT_SEND_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.abort_request_timeout: must be a number of "
                         f"seconds > 0, got {timeout!r}")
    buffer_device = raw.get("kv_buffer_device", "cpu")
    if buffer_device not in ("cpu", "cuda"):
        raise ValueError(f"kv_transfer_config.kv_buffer_device: must be 'cpu' or 'cuda', got {buffer_device!r}")
    if connector == "MultiConnector":
        subs = extra.get("connectors")
        if not isinstance(subs, list) or not subs:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.connectors: MultiConnector needs a "
                             "non-empty list of connector configs")
        for sub in subs:
            if not isinstance(sub, dict) or sub.get("kv_connector") == "MultiConnector":
                raise ValueError("kv_transfer_config.kv_connector_extra_config.connectors: each entry must be a "
                                 f"connector config (not a MultiConnector), got {sub!r}")
    return KVTransferConfig(
        kv_connector=connector, kv_role=role, kv_rank=_int(raw, "kv_rank", None, 0),
        kv_parallel_size=_int(raw, "kv_parallel_size", 1, 1), kv_ip=kv_ip,
        kv_port=_int(raw, "kv_port", None, 0, 65535), engine_id=engine_id, kv_connector_extra_config=dict(extra))


def sub_config(parent: KVTransferConfig, raw: dict[str, Any]) -> KVTransferConfig:
    """One connector of a MultiConnector: its own keys over the parent's role, address and engine id."""
    merged = {"kv_role": parent.kv_role, "kv_ip": parent.kv_ip, "kv_port": parent.kv_port,
              "engine_id": parent.engine_id, **raw}
    sub = parse_kv_transfer_config(merged)
    assert sub is not None
    return sub
