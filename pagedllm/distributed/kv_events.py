"""KV cache events over ZMQ: each engine publishes its batches on a PUB socket; a router subscribes to all.

Wire format (vLLM's): a multipart message ``(topic, seq, payload)``: ``topic`` the configured topic in UTF-8,
``seq`` the batch's number from 0 as 8 bytes big-endian (per publisher; a gap means batches were dropped),
``payload`` a msgpack-encoded ``KVEventBatch`` (``core/kv_events.py``). No torch here.
"""

from __future__ import annotations

import msgspec
import zmq

from pagedllm.core.kv_events import KVEventBatch
from pagedllm.distributed.kv_events_config import KVEventsConfig, parse_kv_events_config
from pagedllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["KVEventsConfig", "parse_kv_events_config", "engine_endpoint", "EventPublisher", "NullEventPublisher",
           "ZmqEventPublisher", "make_event_publisher", "KVEventSubscriber"]


def engine_endpoint(endpoint: str, engine_index: int) -> str:
    """The address engine ``engine_index`` of a data-parallel group binds: the port plus the index for tcp, a
    ``-index`` suffix for ipc/inproc; engine 0 binds ``endpoint`` itself (vLLM offsets by the DP rank)."""
    if engine_index == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}-{engine_index}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit() or base == "tcp":
            raise ValueError(f"kv_events_config.endpoint: {endpoint!r} needs a numeric port to give each of "
                             "several engines its own")
        return f"{base}:{int(port) + engine_index}"
    raise ValueError(f"kv_events_config.endpoint: unsupported address {endpoint!r} (tcp://, ipc:// or inproc://)")


class EventPublisher:
    """Sends an engine's event batches somewhere; this base (and ``NullEventPublisher``) sends nothing."""

    def publish(self, batch: KVEventBatch) -> None:
        """Send one batch (the events of one engine step)."""

    def close(self) -> None:
        """Release the publisher's resources."""


class NullEventPublisher(EventPublisher):
    """Drops every batch (``"publisher": "null"``)."""


class ZmqEventPublisher(EventPublisher):
    """Binds a PUB socket at ``endpoint`` and sends each batch as ``(topic, seq, msgpack payload)``.

    ``publish`` runs on the caller's thread (the engine loop): encoding a step's events and a PUB send take
    microseconds and never block (past ``hwm`` queued messages ZMQ drops for that subscriber), so no thread of
    its own is needed. A ZMQ socket must stay on one thread: call ``publish`` and ``close`` from the same one.
    ``data_parallel_rank`` is stamped on batches that carry none.
    """

    def __init__(self, endpoint: str, topic: str = "kv-events", hwm: int = 100_000,
                 data_parallel_rank: int | None = None, context: zmq.Context | None = None) -> None:
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)  # closing never waits on a slow subscriber
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            raise ValueError(f"kv_events_config.endpoint: cannot bind {endpoint!r}: {e}") from None
        # The address really bound (a tcp port given as * is resolved).
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None and self._rank is not None:
            batch.data_parallel_rank = self._rank
        payload = self._encoder.encode(batch)
        self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), copy=False)
        self._seq += 1

    def close(self) -> None:
        self._socket.close()


def make_event_publisher(config: KVEventsConfig | None, engine_index: int = 0) -> EventPublisher:
    """The publisher engine ``engine_index`` uses for ``config`` (a null one when events are off)."""
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(engine_endpoint(config.endpoint, engine_index), config.topic, config.hwm,
                             data_parallel_rank=engine_index)


class KVEventSubscriber:
    """One SUB socket per engine endpoint; ``poll`` returns what arrived as ``(engine index, batch)`` pairs.

    A malformed message (wrong frame count, topic or sequence width, a payload that does not decode) is logged
    and dropped (``num_malformed``), never raised. A jump in an engine's sequence numbers means batches were
    lost (``num_missed``): that engine's cache view may be stale until its blocks turn over.
    """

    # At most this many messages per socket per poll, so one busy engine cannot starve the others' sockets.
    MAX_MESSAGES_PER_POLL = 1024

    def __init__(self, endpoints: list[str], topic: str = "kv-events", context: zmq.Context | None = None) -> None:
        ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._sockets: list[zmq.Socket] = []
        self._poller = zmq.Poller()
        for endpoint in endpoints:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)  # a prefix filter; the exact topic is checked on receipt
            sock.connect(_connect_address(endpoint))
            self._poller.register(sock, zmq.POLLIN)
            self._sockets.append(sock)
        self._index = {sock: i for i, sock in enumerate(self._sockets)}
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._next_seq: list[int | None] = [None] * len(endpoints)
        self.num_malformed = 0
        self.num_missed = [0] * len(endpoints)

    def poll(self, timeout_ms: int = 0) -> list[tuple[int, KVEventBatch]]:
        """Wait up to ``timeout_ms`` for messages, then return every batch already received, in order per
        engine."""
        out: list[tuple[int, KVEventBatch]] = []
        for sock, _ in self._poller.poll(timeout_ms):
            index = self._index[sock]
            for _ in range(self.MAX_MESSAGES_PER_POLL):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                batch = self._decode(index, frames)
                if batch is not None:
                    out.append((index, batch))
        return out

    def close(self) -> None:
        for sock in self._sockets:
            self._poller.unregister(sock)
            sock.close()

    def _decode(self, index: int, frames: list[bytes]) -> KVEventBatch | None:
        if len(frames) != 3 or frames[0] != self._topic or len(frames[1]) != 8:
            return self._drop(index, f"{len(frames)} frames, topic {frames[0][:64]!r}" if frames else "empty")
        try:
            batch = self._decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._drop(index, str(e))
        seq = int.from_bytes(frames[1], "big")
        expected = self._next_seq[index]
        if expected is not None and seq > expected:
            self.num_missed[index] += seq - expected
            logger.warning("KV events of engine %d: %d batch(es) lost (seq %d, expected %d); its cache view "
                           "may be stale", index, seq - expected, seq, expected)
        elif expected is not None and seq < expected:
            logger.info("KV events of engine %d: sequence restarted at %d (publisher restarted)", index, seq)
        self._next_seq[index] = seq + 1
        return batch

    def _drop(self, index: int, why: str) -> None:
        self.num_malformed += 1
        logger.warning("KV events of engine %d: dropped a malformed message (%s)", index, why)
        return None


def _connect_address(endpoint: str) -> str:
    # A publisher bound to all interfaces (tcp://*:port, 0.0.0.0) is reached locally through loopback.
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint
