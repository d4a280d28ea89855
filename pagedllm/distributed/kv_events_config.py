"""``--kv-events-config``: parse and check vLLM's keys into a ``KVEventsConfig``. No torch, no zmq here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.utils import parse_json_object

# Loopback: nothing is reachable from other hosts unless an address is given (vLLM binds tcp://*:5557).
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_TOPIC = "kv-events"
PUBLISHERS = ("zmq", "null")
_SCHEMES = ("tcp://", "ipc://", "inproc://")
_KNOWN_KEYS = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "hwm", "replay_endpoint"}


@dataclass
class KVEventsConfig:
    """Whether an engine publishes its KV cache events, and where.

    ``publisher``: ``zmq`` (a PUB socket bound at ``endpoint``; engine ``i`` of a data-parallel group binds
    ``engine_endpoint(endpoint, i)``) or ``null`` (events are not sent). ``hwm``: messages the PUB socket
    queues per subscriber before it drops (ZMQ's high-water mark). vLLM's ``replay_endpoint`` is not supported.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    topic: str = DEFAULT_TOPIC
    hwm: int = 100_000

    @property
    def publishes(self) -> bool:
        """True when events are recorded and sent over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(raw: str | dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
    """A JSON string or dict with vLLM's keys → KVEventsConfig (None stays None).

    ``publisher`` defaults to ``zmq`` when events are enabled, else ``null`` (as in vLLM). Raises ValueError
    naming the offending key.
    """
    if raw is None or isinstance(raw, KVEventsConfig):
        return raw
    raw = parse_json_object(raw, "kv_events_config", _KNOWN_KEYS)
    if raw.get("replay_endpoint") is not None:
        raise ValueError("kv_events_config.replay_endpoint: replaying missed events is not supported; leave it "
                         "out (a subscriber that misses batches sees a gap in their sequence numbers)")
    enabled = raw.get("enable_kv_cache_events", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"kv_events_config.enable_kv_cache_events: must be true or false, got {enabled!r}")
    publisher = raw.get("publisher")
    if publisher is None:
        publisher = "zmq" if enabled else "null"
    if publisher not in PUBLISHERS:
        raise ValueError(f"kv_events_config.publisher: must be one of {list(PUBLISHERS)}, got {publisher!r}")
    endpoint = raw.get("endpoint", DEFAULT_ENDPOINT)
    if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
        raise ValueError(f"kv_events_config.endpoint: must be a ZMQ address starting with one of {list(_SCHEMES)}, "
                         f"got {endpoint!r}")
    topic = raw.get("topic", DEFAULT_TOPIC)
    if not isinstance(topic, str):
        raise ValueError(f"kv_events_config.topic: must be a string, got {topic!r}")
    hwm = raw.get("hwm", KVEventsConfig.hwm)
    if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < 0:
        raise ValueError(f"kv_events_config.hwm: must be an integer >= 0, got {hwm!r}")
    return KVEventsConfig(enable_kv_cache_events=enabled, publisher=publisher, endpoint=endpoint, topic=topic,
                          hwm=hwm)
