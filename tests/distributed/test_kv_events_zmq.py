"""KV cache events over a real ZMQ PUB/SUB pair (ipc:// in a temp dir), the config and the DP endpoints."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from pagedllm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagedllm.distributed.kv_events import (
    KVEventsConfig,
    KVEventSubscriber,
    NullEventPublisher,
    ZmqEventPublisher,
    engine_endpoint,
    make_event_publisher,
    parse_kv_events_config,
)

DEADLINE_S = 10.0


@pytest.fixture
def ipc_base() -> Iterator[str]:
    # Short path: ipc addresses are limited to ~107 bytes.
    with tempfile.TemporaryDirectory(prefix="kvev", dir="/tmp") as d:
        yield f"ipc://{d}/events"


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(ts=float(n), events=[BlockStored([n, n + 1], None, list(range(8)), 4), BlockRemoved([n]),
                                             AllBlocksCleared()])


def receive(sub: KVEventSubscriber, send: Callable[[], None], want: int = 1,
            engine: int | None = None) -> list[tuple[int, KVEventBatch]]:
    """Send until ``want`` batches (of ``engine``, if given) arrive: a SUB socket misses what is published
    before it has joined, so the first sends may be lost and the last ones may still arrive later."""
    got: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < want:
        assert time.monotonic() < deadline, "no KV events received before the deadline"
        send()
        got.extend(item for item in sub.poll(50) if engine is None or item[0] == engine)
    return got


def test_engine_endpoints_offset_by_index():
    assert engine_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert engine_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert engine_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert engine_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv-2"
    with pytest.raises(ValueError, match="endpoint"):
        engine_endpoint("tcp://127.0.0.1:*", 1)


def test_config_defaults_and_errors():
    assert parse_kv_events_config(None) is None
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert cfg == KVEventsConfig(True, "zmq", "tcp://127.0.0.1:5557", "kv-events") and cfg.publishes
    assert parse_kv_events_config({"publisher": "null", "enable_kv_cache_events": True}).publishes is False
    assert parse_kv_events_config({}).publisher == "null"
    for raw, field in [("{not json", "kv_events_config"), ("[1]", "kv_events_config"),
                       ({"endpiont": "x"}, "unknown key"), ({"replay_endpoint": "tcp://127.0.0.1:5558"},
                                                             "replay_endpoint"),
                       ({"publisher": "kafka"}, "publisher"), ({"endpoint": "http://x"}, "endpoint"),
                       ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"), ({"hwm": -1}, "hwm")]:
        with pytest.raises(ValueError, match=field):
            parse_kv_events_config(raw)


def test_publisher_for_a_config():
    assert isinstance(make_event_publisher(None), NullEventPublisher)
    assert isinstance(make_event_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null")),
                      NullEventPublisher)


def test_batches_reach_the_subscriber_with_their_engine_index(ipc_base):
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=ipc_base)
    pubs = [make_event_publisher(cfg, i) for i in range(2)]
    sub = KVEventSubscriber([engine_endpoint(ipc_base, i) for i in range(2)], cfg.topic)
    try:
        assert pubs[1].endpoint == ipc_base + "-1"
        got = receive(sub, lambda: pubs[1].publish(batch(7)), engine=1)
        assert got[0][1].events == batch(7).events and got[0][1].data_parallel_rank == 1
        got = receive(sub, lambda: pubs[0].publish(batch(3)), engine=0)
        assert got[0][1].data_parallel_rank == 0
        # Joined now: a burst arrives whole and in order (late copies of the joining sends are skipped).
        for n in range(100, 120):
            pubs[0].publish(batch(n))
        burst: list[float] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(burst) < 20 and time.monotonic() < deadline:
            burst += [b.ts for i, b in sub.poll(50) if i == 0 and b.ts >= 100]
        assert burst == [float(n) for n in range(100, 120)] and sub.num_missed == [0, 0]
    finally:
        sub.close()
        for pub in pubs:
            pub.close()


def test_frames_are_topic_seq_payload(ipc_base):
    pub = ZmqEventPublisher(ipc_base, topic="t")
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(ipc_base)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not raw.poll(50):
            assert time.monotonic() < deadline
            pub.publish(batch(1))
        topic, seq, payload = raw.recv_multipart()
        assert topic == b"t" and len(seq) == 8 and int.from_bytes(seq, "big") >= 0
        assert msgspec.msgpack.decode(payload, type=KVEventBatch).events == batch(1).events
    finally:
        raw.close(linger=0)
        pub.close()


def test_malformed_messages_are_dropped_not_raised(ipc_base):
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ipc_base)
    sub = KVEventSubscriber([ipc_base], "kv-events")
    good = msgspec.msgpack.encode(batch(5))
    seq = iter(range(10_000))

    def send_junk_then_good() -> None:
        pub.send_multipart([b"kv-events", b"\x00" * 8])  # two frames
        pub.send_multipart([b"kv-events", b"\x00" * 3, good])  # short sequence number
        pub.send_multipart([b"kv-events", b"\x00" * 8, b"\xc1not msgpack"])
        pub.send_multipart([b"kv-events", b"\x00" * 8, msgspec.msgpack.encode({"ts": "x"})])  # wrong shape
        pub.send_multipart([b"kv-events", next(seq).to_bytes(8, "big"), good])

    try:
        receive(sub, send_junk_then_good)  # joined: from now on nothing is lost, so send once
        before = sub.num_malformed
        send_junk_then_good()
        got = receive(sub, lambda: None)
        assert [b.events for _, b in got] == [batch(5).events]
        assert sub.num_malformed - before == 4
    finally:
        sub.close()
        pub.close()


def test_a_sequence_gap_is_counted(ipc_base):
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ipc_base)
    sub = KVEventSubscriber([ipc_base], "kv-events")
    payload = msgspec.msgpack.encode(batch(0))
    try:
        receive(sub, lambda: pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), payload]))
        pub.send_multipart([b"kv-events", (4).to_bytes(8, "big"), payload])
        receive(sub, lambda: None)
        assert sub.num_missed == [3]  # 1, 2 and 3 never came
    finally:
        sub.close()
        pub.close()
