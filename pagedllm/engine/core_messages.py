"""The typed messages between the API process and its engine-core processes (msgspec over ZMQ).

Sockets (``engine/core_client.py``): the client binds a ROUTER for input and a PULL for output; each engine
connects a DEALER (identity = its index, 2 bytes little-endian) and a PUSH. Every message is two frames:
``[type, payload]`` (the ROUTER adds the identity in front). Payloads are msgpack, typed by the structs
below, so nothing but these types crosses: no pickles, no closures.

Engine -> client on the input socket (the handshake): ``HELLO`` once the process is up, then ``READY`` once the
model is loaded and the KV cache sized, or ``FAILED`` if that raised. Client -> engine: ``ADD``, ``ABORT``,
``UTILITY``, ``SHUTDOWN``. Engine -> client on the output socket: ``OUTPUTS`` after every step and for every
utility result, ``DEAD`` (with the reason) when its loop raised.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.lora.request import AdapterRef
from pagedllm.multimodal.wire import WireFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestType(bytes, enum.Enum):
    ADD = b"A"
    ABORT = b"X"  # payload: AbortRequests
    UTILITY = b"U"
    SHUTDOWN = b"S"


class EngineMessageType(bytes, enum.Enum):
    HELLO = b"H"
    READY = b"R"
    FAILED = b"F"
    OUTPUTS = b"O"
    DEAD = b"D"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine request (a child of an ``n > 1`` request is one of these): what ``core.request.Request`` needs."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    # An encoder-decoder request's encoder input (float32 audio_features): its raw bytes and shape.
    encoder_input: bytes | None = None
    encoder_input_shape: list[int] | None = None
    # The prompt's images (placeholder runs, content hashes, processed pixels), multimodal/wire.py.
    mm_features: list[WireFeature] | None = None
    lora: AdapterRef | None = None  # its LoRA adapter (name, id, path, content digest)


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]
    # "abort" (the client went away) or "stop" (the detokenizer found a stop string).
    reason: str = "abort"


class UtilityCall(msgspec.Struct, array_like=True):
    """A named method of the engine process (``EngineCoreProc.UTILITIES``), answered by ``UtilityResult``."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's outputs of one engine, with its scheduler stats (absent for a utility-only message)."""

    engine_index: int
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    utility_result: UtilityResult | None = None
    timestamp: float = 0.0


class Hello(msgspec.Struct, array_like=True):
    engine_index: int
    pid: int


class Ready(msgspec.Struct, array_like=True):
    """The engine is serving. Its ``KVCacheLayout`` (``config.py``: blocks, windows, device, resolved while the
    worker sized the KV cache) lets the API side check that a prompt fits before it queues it."""

    engine_index: int
    num_blocks: int
    max_model_len: int
    sliding_window: int | None = None
    sliding_group_window: int | None = None
    sliding_group_num_blocks: int = 0
    num_lookahead_tokens: int = 0
    device: str = "cpu"
    cross_group_num_blocks: int = 0


class Failure(msgspec.Struct, array_like=True):
    """``FAILED`` (start-up) or ``DEAD`` (the loop raised): which engine, and why."""

    engine_index: int
    reason: str


_encoder = msgspec.msgpack.Encoder()
_DECODERS = {
    RequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    RequestType.ABORT: msgspec.msgpack.Decoder(AbortRequests),
    RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
    EngineMessageType.HELLO: msgspec.msgpack.Decoder(Hello),
    EngineMessageType.READY: msgspec.msgpack.Decoder(Ready),
    EngineMessageType.FAILED: msgspec.msgpack.Decoder(Failure),
    EngineMessageType.DEAD: msgspec.msgpack.Decoder(Failure),
    EngineMessageType.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
}


def encode(message: msgspec.Struct | None) -> bytes:
    return b"" if message is None else _encoder.encode(message)


def decode(kind: RequestType | EngineMessageType, payload: bytes) -> Any:
    """Decode one payload by its type frame; raises ``msgspec.DecodeError`` / ``ValueError`` on a bad frame."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        return None
    return decoder.decode(payload)


def parse_frames(frames: list[bytes], kinds: type[enum.Enum]) -> tuple[Any, Any]:
    """``[type, payload]`` -> (type, message). ValueError for a frame this side does not know."""
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    kind = kinds(bytes(frames[0]))  # ValueError for an unknown type
    return kind, decode(kind, frames[1])
