"""Each step's ``SchedulerOutput``, sent once to every tensor-parallel rank: msgpack (msgspec) over a ZMQ PUB
socket that all ranks subscribe to. One encode per step whatever the number of ranks; no pickles.

Messages are two frames ``[kind, payload]``: ``INIT`` (the KV cache size rank 0 settled on), ``STEP`` (one
scheduler output) and ``STOP``. The grammar bitmask of a step travels as raw int32 bytes (resolved first: a
background fill is a Future on rank 0). Ranks answer on a PUSH socket: ``READY`` (their own KV block count) and
the acknowledgement of the subscription probe (PUB drops messages sent before a subscriber is connected).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from pagedllm.config import KVCacheLayout
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.lora.request import AdapterRef
from pagedllm.multimodal.wire import WireFeature, pack_mm_features, unpack_mm_features
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PROBE, INIT, STEP, STOP = b"P", b"I", b"S", b"X"
READY, ACK = b"R", b"A"


class WireNewRequest(msgspec.Struct):
    """``NewRequestData`` as received: the same attribute names, so the runner reads it as it is."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    mm_features: list[WireFeature] = []  # MultiModalFeature objects again once decoded
    lora: AdapterRef | None = None


class WireCachedRequest(msgspec.Struct):
    req_id: str
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int


class WireStep(msgspec.Struct):
    """``SchedulerOutput`` as received (same names; ``grammar_bitmask`` a tensor once decoded)."""

    scheduled_new_reqs: list[WireNewRequest]
    scheduled_cached_reqs: list[WireCachedRequest]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = set()
    preempted_req_ids: set[str] = set()
    structured_output_request_ids: list[str] = []
    grammar_bitmask: Any = None  # on the wire: [shape, int32 bytes]
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    free_encoder_hashes: list[str] = []

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class WireInit(msgspec.Struct, array_like=True):
    """The KV cache layout rank 0 settled on for every rank (``KVCacheLayout``'s fields)."""

    num_blocks: int
    sliding_group_num_blocks: int = 0
    device: str = "cpu"
    sliding_window: int | None = None
    sliding_group_window: int | None = None
    cross_group_num_blocks: int = 0

    def layout(self) -> KVCacheLayout:
        return KVCacheLayout(num_blocks=self.num_blocks, device=self.device, sliding_window=self.sliding_window,
                             sliding_group_window=self.sliding_group_window,
                             sliding_group_num_blocks=self.sliding_group_num_blocks,
                             cross_group_num_blocks=self.cross_group_num_blocks)


class WireReady(msgspec.Struct, array_like=True):
    rank: int
    num_blocks: int


_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(WireStep)
_init_decoder = msgspec.msgpack.Decoder(WireInit)
_ready_decoder = msgspec.msgpack.Decoder(WireReady)


def encode_step(sched: SchedulerOutput) -> bytes:
    """``sched`` as one msgpack payload, encoded by msgspec from the dataclasses themselves (one C call); the
    grammar bitmask (waited for, when it is still being filled) as its shape and raw int32 bytes."""
    if sched.grammar_bitmask is not None:
        if sched.structured_output_request_ids:
            from pagedllm.structured_output.manager import resolve_bitmask

            arr = np.ascontiguousarray(np.asarray(resolve_bitmask(sched.grammar_bitmask)), dtype=np.int32)
            sched = dataclasses.replace(sched, grammar_bitmask=[list(arr.shape), arr.tobytes()])
        else:
            sched = dataclasses.replace(sched, grammar_bitmask=None)
    if any(new.mm_features for new in sched.scheduled_new_reqs):  # images: their arrays as bytes
        sched = dataclasses.replace(sched, scheduled_new_reqs=[
            dataclasses.replace(new, mm_features=pack_mm_features(new.mm_features) or [])
            for new in sched.scheduled_new_reqs])
    return _encoder.encode(sched)


def decode_step(payload: bytes) -> WireStep:
    """A payload of ``encode_step`` -> a ``WireStep`` that reads as the ``SchedulerOutput`` it was made from."""
    step = _step_decoder.decode(payload)
    for new in step.scheduled_new_reqs:
        if new.mm_features:
            new.mm_features = unpack_mm_features(new.mm_features)
    if step.grammar_bitmask is not None:
        import torch

        shape, raw = step.grammar_bitmask
        step.grammar_bitmask = torch.from_numpy(np.frombuffer(raw, dtype=np.int32).reshape(shape).copy())
    return step


class StepPublisher:
    """Rank 0's side: a PUB socket for the steps, a PULL socket for the ranks' answers."""

    def __init__(self, ctx: zmq.Context, step_address: str, answer_address: str) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self.pub.bind(step_address)
        self.answers = ctx.socket(zmq.PULL)
        self.answers.setsockopt(zmq.LINGER, 0)
        self.answers.bind(answer_address)
        self.encode_s = 0.0  # time spent encoding and sending steps (the benchmark's broadcast cost)
        self.num_steps = 0

    def wait_subscribed(self, num_subscribers: int, timeout_s: float, alive: Any) -> None:
        """Probe until every subscriber acknowledged (their subscriptions have reached this socket)."""
        acked: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(acked) < num_subscribers:
            alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {sorted(set(range(1, num_subscribers + 1)) - acked)} "
                                   f"did not subscribe to the step broadcast within {timeout_s:.0f} s")
            self.pub.send_multipart([PROBE, b""])
            while self.answers.poll(20):
                kind, payload = self.answers.recv_multipart()
                if kind == ACK:
                    acked.add(int(payload))

    def recv_ready(self, timeout_ms: int) -> WireReady | None:
        if not self.answers.poll(timeout_ms):
            return None
        kind, payload = self.answers.recv_multipart()
        return _ready_decoder.decode(payload) if kind == READY else None

    def send_init(self, layout: KVCacheLayout) -> None:
        """Every rank allocates ``layout``."""
        message = WireInit(layout.num_blocks, layout.sliding_group_num_blocks, layout.device, layout.sliding_window,
                           layout.sliding_group_window, layout.cross_group_num_blocks)
        self.pub.send_multipart([INIT, _encoder.encode(message)])

    def send_step(self, sched: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        self.pub.send_multipart([STEP, encode_step(sched)], copy=False)
        self.encode_s += time.perf_counter() - t0
        self.num_steps += 1

    def send_stop(self) -> None:
        self.pub.send_multipart([STOP, b""])

    def close(self) -> None:
        self.pub.close()
        self.answers.close()


class StepSubscriber:
    """A rank's side: the SUB socket it reads steps from, the PUSH socket it answers on."""

    def __init__(self, ctx: zmq.Context, rank: int, step_address: str, answer_address: str) -> None:
        self.rank = rank
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(step_address)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.connect(answer_address)
        self._acked = False

    def send_ready(self, num_blocks: int) -> None:
        self.push.send_multipart([READY, _encoder.encode(WireReady(self.rank, num_blocks))])

    def recv(self) -> tuple[bytes, Any]:
        """The next message that is not a probe: (INIT, WireInit) | (STEP, SchedulerOutput) | (STOP, None)."""
        while True:
            kind, payload = self.sub.recv_multipart()
            if kind == PROBE:
                if not self._acked:
                    self._acked = True
                    self.push.send_multipart([ACK, str(self.rank).encode()])
                continue
            if kind == INIT:
                return kind, _init_decoder.decode(payload)
            if kind == STEP:
                return kind, decode_step(payload)  # a WireStep: read by the runner as a SchedulerOutput
            return STOP, None

    def close(self) -> None:
        self.sub.close()
        self.push.close()
