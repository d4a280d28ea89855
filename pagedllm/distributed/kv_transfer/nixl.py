"""``NixlConnector``: a prompt's KV blocks read straight from the prefill instance's cache into the decode
instance's, over NIXL (UCX; DRAM to DRAM on a CPU, VRAM on a GPU). Whole blocks, in the cache's own layout.

The protocol (vLLM's, in outline):
1. The producer (prefill) finishes a request that asked ``do_remote_decode``: its blocks are **held** and the
   response carries ``kv_transfer_params``: ``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``,
   ``remote_host`` / ``remote_port`` (its side channel) and ``remote_request_id``.
2. The consumer (decode) gets a request with those params: the scheduler allocates blocks for the whole prompt and
   parks it in ``WAITING_FOR_REMOTE_KVS``. The worker half **handshakes** once per producer over the side channel
   (a ZMQ request: the producer's NIXL agent metadata, its caches' base addresses and layout), on a thread, with a
   timeout; then posts one NIXL READ of all the blocks with the producer's request id as the notification.
3. NIXL delivers the notification to the producer when the READ completes: the producer's blocks are freed.
   A consumer request aborted before its READ was posted sends that notification itself (the producer frees at
   once); one aborted mid-READ keeps its blocks until the READ ends. A producer frees blocks nobody reads after
   ``abort_request_timeout`` seconds (extra config; default 180).
4. A handshake or READ that fails (or a READ that outlives ``transfer_timeout``, default 30 s) reports the request
   in ``failed_recving``: the decode instance recomputes the prompt itself.

Access: the side channel binds ``kv_ip`` (loopback by default) on ``kv_port``, else ``VLLM_NIXL_SIDE_CHANNEL_PORT``,
else a free port. A consumer reads only from side channels listed in ``peers`` (extra config, ``"host:port"``
strings; absent: any port on a loopback address); a producer answers only the engine ids in ``peer_engine_ids``
when given, and takes release notifications only from agents that handshook with it.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from pagedllm import envs
from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    kv_transfer_params,
)
from pagedllm.logger import init_logger
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig

logger = init_logger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
TRANSFER_TIMEOUT_S = 30.0
# NIXL's Python agent runs its progress thread with no pause between passes (nixl_agent sets pthrDelay = 0): an
# idle connector spins one core (measured: docs/performance.md), on a CPU instance a core taken from the
# model. The thread is needed (a READ completes, and a peer's wire-up is answered, only while the UCX worker
# progresses), so host-memory caches keep it with this pause, microseconds; a DRAM READ itself is copied when it
# is posted (UCX's cma transport: process_vm_readv), so only its completion waits for the next pass.
HOST_PROGRESS_PAUSE_US = 200
_REMOTE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_request_id")


class HandshakeRequest(msgspec.Struct):
    engine_id: str


class HandshakeReply(msgspec.Struct):
    """What a consumer needs to read a producer's blocks: cache ``layer``'s block ``b``, K (``kv=0``) or V
    (``kv=1``), starts at ``base_addrs[layer] + (kv * num_blocks + b) * block_bytes``."""

    ok: bool
    error: str = ""
    engine_id: str = ""
    agent_metadata: bytes = b""
    base_addrs: list[int] = []
    num_blocks: int = 0
    block_bytes: int = 0
    mem_type: str = "DRAM"
    device_id: int = 0
    kv_format: str = ""  # the producer's KVConnectorBase_V1.kv_format: the consumer's must be the same


@dataclass
class RecvSpec:
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    cancelled: bool = False  # aborted before the worker half saw it: only release the producer's blocks
    error: str | None = None  # the params were unusable: fail at once (the prompt is recomputed)


@dataclass
class NixlMetadata(KVConnectorMetadata):
    recv: dict[str, RecvSpec] = field(default_factory=dict)
    send: dict[str, list[int]] = field(default_factory=dict)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NixlConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int) -> None:
        super().__init__(config, role, block_size)
        extra = config.kv_connector_extra_config
        self.handshake_timeout_s = float(extra.get("handshake_timeout", HANDSHAKE_TIMEOUT_S))
        self.transfer_timeout_s = float(extra.get("transfer_timeout", TRANSFER_TIMEOUT_S))
        self.peers = {str(p) for p in extra.get("peers", [])}
        self.peer_engine_ids = {str(e) for e in extra.get("peer_engine_ids", [])}
        # Scheduler half.
        self._recv: dict[str, RecvSpec] = {}
        self._send: dict[str, list[int]] = {}
        self._receiving: set[str] = set()  # WAITING_FOR_REMOTE_KVS
        self._received: set[str] = set()  # asked once: never read again (the producer frees after one read)
        self._worker: NixlConnector | None = None
        # Worker half (set up in register_kv_caches).
        self.side_channel_port: int | None = None
        self.num_blocks_received = 0
        self.transfer_seconds = 0.0  # summed over completed READs (for the per-block figure)

    # ---- scheduler half ------------------------------------------------------------------------------
    def bind_worker(self, worker: KVConnectorBase_V1) -> None:
        assert isinstance(worker, NixlConnector)
        self._worker = worker

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = kv_transfer_params(request)
        if not self.config.is_kv_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if request.request_id in self._received:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = kv_transfer_params(request) or {}
        rid = request.request_id
        self._receiving.add(rid)
        self._received.add(rid)
        first = request.num_local_hit_tokens // self.block_size
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        error = None
        missing = [k for k in _REMOTE_KEYS if params.get(k) is None]
        remote = params.get("remote_block_ids")
        if missing:
            error = f"kv_transfer_params: missing {missing}"
        elif not isinstance(remote, list) or len(remote) != num_blocks:
            error = (f"kv_transfer_params.remote_block_ids: {num_blocks} blocks expected for a "
                     f"{request.num_prompt_tokens}-token prompt")
        self._recv[rid] = RecvSpec(
            local_block_ids=list(block_ids[first:num_blocks]),
            remote_block_ids=list(remote[first:num_blocks]) if error is None else [],
            remote_engine_id=str(params.get("remote_engine_id")), remote_host=str(params.get("remote_host")),
            remote_port=int(params.get("remote_port") or 0), remote_request_id=str(params.get("remote_request_id")),
            error=error)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlMetadata:
        meta = NixlMetadata(recv=self._recv, send=self._send)
        self._recv, self._send = {}, {}
        for rid in scheduler_output.num_scheduled_tokens:
            self._receiving.discard(rid)  # scheduled: its KV is in (or it fell back to recomputing)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._received.discard(rid)
        if rid in self._receiving:  # aborted while its blocks arrive (or before the READ was posted)
            self._receiving.discard(rid)
            if rid in self._recv:
                self._recv[rid].cancelled = True
            return True, None
        params = kv_transfer_params(request) or {}
        if not (self.config.is_kv_producer and params.get("do_remote_decode")):
            return False, None
        if request.status.finish_reason not in ("stop", "length") or not block_ids:
            return False, None  # aborted or failed: nothing worth reading
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        self._send[rid] = list(block_ids)
        worker = self._worker
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(block_ids[:num_blocks]), "remote_engine_id": self.config.engine_id,
            "remote_host": self.config.kv_ip, "remote_port": worker.side_channel_port if worker else None,
            "remote_request_id": rid,
        }

    # ---- worker half ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        import zmq

        from pagedllm.platforms import platform_of

        self.kv_caches = list(kv_caches)
        first = self.kv_caches[0]
        self.num_blocks = first.shape[1]
        self.block_bytes = first[0, 0].numel() * first.element_size()
        # NIXL's memory kinds: host memory, or an accelerator's (the platform tells which the cache is on).
        self.mem_type = "VRAM" if platform_of(first).is_accelerator else "DRAM"
        self.device_id = max(first.get_device(), 0)
        for cache in self.kv_caches:
            if not cache.is_contiguous() or cache.shape != first.shape:
                raise ValueError("kv_transfer_config: NixlConnector needs one contiguous cache tensor per layer")
        self.agent = _nixl_agent(self.config.engine_id, HOST_PROGRESS_PAUSE_US if self.mem_type == "DRAM" else None)
        regions = [(c.data_ptr(), c.numel() * c.element_size(), self.device_id, "") for c in self.kv_caches]
        self._registered = self.agent.register_memory(regions, self.mem_type)
        self.base_addrs = [c.data_ptr() for c in self.kv_caches]
        # Producer: request id -> deadline; the agents that handshook with us (release notices come from them).
        self._sending: dict[str, float] = {}
        self._consumers: set[str] = set()
        # Consumer: request id -> [spec, state, xfer handle, started]; producers by (host, port).
        self._recvs: dict[str, list] = {}
        self._peers: dict[tuple[str, int], Future] = {}
        self._remote_agents: dict[tuple[str, int], tuple[str, HandshakeReply]] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="pagedllm-nixl-handshake")
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._listener = self._ctx.socket(zmq.ROUTER)
        self._listener.setsockopt(zmq.LINGER, 0)
        port = self.config.kv_port if self.config.kv_port is not None else envs.VLLM_NIXL_SIDE_CHANNEL_PORT
        host = self.config.kv_ip if ":" not in self.config.kv_ip else f"[{self.config.kv_ip}]"
        if ":" in self.config.kv_ip:
            self._listener.setsockopt(zmq.IPV6, 1)
        if port:
            self._listener.bind(f"tcp://{host}:{port}")
            self.side_channel_port = int(port)
        else:
            self.side_channel_port = self._listener.bind_to_random_port(f"tcp://{host}")
        self._serve_thread = threading.Thread(target=self._serve_handshakes, name="pagedllm-nixl-side-channel",
                                              daemon=True)
        self._serve_thread.start()
        logger.info("NixlConnector %s (%s): side channel on %s:%d, %d layers x %d blocks of %d bytes (%s)",
                    self.config.engine_id, self.config.kv_role, self.config.kv_ip, self.side_channel_port,
                    len(self.kv_caches), self.num_blocks, self.block_bytes, self.mem_type)

    def _serve_handshakes(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._listener, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                identity, _, payload = self._listener.recv_multipart()
                reply = self._answer(payload)
                self._listener.send_multipart([identity, b"", msgspec.msgpack.encode(reply)])
            except Exception:  # noqa: BLE001 - a bad handshake costs that peer only
                logger.exception("NixlConnector: bad handshake message")

    def _answer(self, payload: bytes) -> HandshakeReply:
        try:
            req = msgspec.msgpack.decode(payload, type=HandshakeRequest)
        except msgspec.DecodeError:
            return HandshakeReply(False, "malformed handshake")
        if not self.config.is_kv_producer:
            return HandshakeReply(False, f"engine {self.config.engine_id} is not a KV producer")
        if self.peer_engine_ids and req.engine_id not in self.peer_engine_ids:
            logger.warning("NixlConnector: refused a handshake from engine %r (not in peer_engine_ids)", req.engine_id)
            return HandshakeReply(False, f"engine {req.engine_id!r} is not a configured peer")
        self._consumers.add(req.engine_id)
        return HandshakeReply(True, engine_id=self.config.engine_id, agent_metadata=self.agent.get_agent_metadata(),
                              base_addrs=self.base_addrs, num_blocks=self.num_blocks, block_bytes=self.block_bytes,
                              mem_type=self.mem_type, device_id=self.device_id, kv_format=self.kv_format)

    def _handshake(self, host: str, port: int) -> HandshakeReply:
        import zmq

        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.handshake_timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(self.handshake_timeout_s * 1000))
        try:
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
                host = f"[{host}]"
            sock.connect(f"tcp://{host}:{port}")
            sock.send(msgspec.msgpack.encode(HandshakeRequest(self.config.engine_id)))
            return msgspec.msgpack.decode(sock.recv(), type=HandshakeReply)
        except zmq.Again:
            return HandshakeReply(False, f"no answer from {host}:{port} in {self.handshake_timeout_s:g} s")
        finally:
            sock.close()

    def _peer_allowed(self, host: str, port: int) -> bool:
        if self.peers:
            return f"{host}:{port}" in self.peers
        return _is_loopback(host)

    def start_load_kv(self, forward_context: Any = None) -> None:
        meta = self._metadata
        if not isinstance(meta, NixlMetadata):
            return
        now = time.monotonic()
        for rid in meta.send:
            self._sending[rid] = now + self.config.send_timeout_s
        for rid, spec in meta.recv.items():
            key = (spec.remote_host, spec.remote_port)
            if spec.error is None and not self._peer_allowed(*key):
                spec.error = f"side channel {spec.remote_host}:{spec.remote_port} is not a configured peer"
            if spec.error is None and key not in self._peers and key not in self._remote_agents:
                self._peers[key] = self._pool.submit(self._handshake, *key)
            self._recvs[rid] = [spec, "handshake", None, now]

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        self._finish_handshakes()
        now = time.monotonic()
        for rid, entry in list(self._recvs.items()):
            spec, state, handle, started = entry
            if rid in finished_req_ids:
                spec.cancelled = True
            if state == "handshake":
                self._advance(rid, entry, out)
            elif state == "reading":
                status = self.agent.check_xfer_state(handle)
                if status == "DONE" or status == "ERR" or now - started > self.transfer_timeout_s:
                    self.agent.release_xfer_handle(handle)
                    del self._recvs[rid]
                    if status == "DONE":
                        self.num_blocks_received += len(spec.local_block_ids)
                        self.transfer_seconds += now - started
                        logger.debug("NixlConnector: %s: %d blocks in %.2f ms", rid, len(spec.local_block_ids),
                                     (now - started) * 1e3)
                        out.finished_recving.add(rid)
                    else:
                        logger.warning("NixlConnector: READ for %s %s", rid,
                                       "failed" if status == "ERR" else "timed out")
                        (out.finished_recving if spec.cancelled else out.failed_recving).add(rid)
        self._finish_sends(now, out)
        return out

    def _finish_handshakes(self) -> None:
        for key, future in list(self._peers.items()):
            if not future.done():
                continue
            del self._peers[key]
            try:
                reply = future.result()
            except Exception as e:  # noqa: BLE001
                reply = HandshakeReply(False, f"{type(e).__name__}: {e}")
            if not reply.ok:
                logger.warning("NixlConnector: handshake with %s:%d failed: %s", key[0], key[1], reply.error)
                self._remote_agents.pop(key, None)
                for entry in self._recvs.values():
                    if (entry[0].remote_host, entry[0].remote_port) == key and entry[1] == "handshake":
                        entry[0].error = f"handshake failed: {reply.error}"
                continue
            name = self.agent.add_remote_agent(reply.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._remote_agents[key] = (name, reply)

    def _advance(self, rid: str, entry: list, out: KVConnectorOutput) -> None:
        """A receive past its handshake: post the READ, release the producer's blocks, or give up."""
        spec: RecvSpec = entry[0]
        key = (spec.remote_host, spec.remote_port)
        if spec.error is not None:
            del self._recvs[rid]
            logger.warning("NixlConnector: cannot receive %s: %s", rid, spec.error)
            (out.finished_recving if spec.cancelled else out.failed_recving).add(rid)
            return
        peer = self._remote_agents.get(key)
        if peer is None:
            return  # handshake still running
        name, reply = peer
        if spec.cancelled:  # aborted before any byte moved: the producer may free its blocks now
            self.agent.send_notif(name, spec.remote_request_id.encode())
            del self._recvs[rid]
            out.finished_recving.add(rid)
            return
        if reply.engine_id != spec.remote_engine_id or reply.block_bytes != self.block_bytes or \
                reply.kv_format != self.kv_format or len(reply.base_addrs) != len(self.base_addrs) or \
                max(spec.remote_block_ids, default=0) >= reply.num_blocks:
            del self._recvs[rid]
            logger.warning("NixlConnector: %s: the producer at %s:%d (engine %s) does not match the request or this "
                           "cache's layout or format (dtype, fp8 scales)", rid, key[0], key[1], reply.engine_id)
            out.failed_recving.add(rid)
            return
        runs = block_runs(spec.local_block_ids, spec.remote_block_ids)
        local = _block_descs(self.base_addrs, self.num_blocks, self.block_bytes, [(a, n) for a, _, n in runs],
                             self.device_id)
        remote = _block_descs(reply.base_addrs, reply.num_blocks, self.block_bytes, [(b, n) for _, b, n in runs],
                              reply.device_id)
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem_type),
                                            self.agent.get_xfer_descs(remote, reply.mem_type), name,
                                            spec.remote_request_id.encode())
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            del self._recvs[rid]
            out.failed_recving.add(rid)
            return
        entry[1], entry[2], entry[3] = "reading", handle, time.monotonic()

    def _finish_sends(self, now: float, out: KVConnectorOutput) -> None:
        if not self._sending:
            return
        for agent_name, messages in self.agent.get_new_notifs().items():
            if agent_name not in self._consumers:
                logger.warning("NixlConnector: ignored notifications from %r (it never handshook)", agent_name)
                continue
            for message in messages:
                rid = message.decode(errors="replace")
                if self._sending.pop(rid, None) is not None:
                    out.finished_sending.add(rid)
        for rid, deadline in list(self._sending.items()):
            if now > deadline:
                del self._sending[rid]
                logger.warning("NixlConnector: no decode instance read the blocks of %s in %.0f s; freeing them",
                               rid, self.config.send_timeout_s)
                out.finished_sending.add(rid)

    def shutdown(self) -> None:
        if getattr(self, "_stop", None) is None:
            return
        self._stop.set()
        self._serve_thread.join(timeout=1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._listener.close()
        self._ctx.term()


def block_runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, length) of the stretches where both block id lists count up by one: each is one
    contiguous region per layer and K/V half on both sides, so one descriptor instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(local, remote):
        if runs:
            la, lb, n = runs[-1]
            if a == la + n and b == lb + n:
                runs[-1] = (la, lb, n + 1)
                continue
        runs.append((a, b, 1))
    return runs


def _block_descs(base_addrs: list[int], num_blocks: int, block_bytes: int, runs: list[tuple[int, int]],
                 device_id: int):
    """[layers * 2 * len(runs), 3] (address, bytes, device) of the K and V of each run of blocks (first block id,
    count) in every layer."""
    import numpy as np

    starts = np.asarray([r[0] for r in runs], dtype=np.int64)
    sizes = np.asarray([r[1] for r in runs], dtype=np.int64) * block_bytes
    bases = np.asarray(base_addrs, dtype=np.int64)[:, None, None]
    halves = (np.arange(2, dtype=np.int64) * num_blocks)[None, :, None]
    addrs = (bases + (halves + starts[None, None, :]) * block_bytes).ravel()
    lengths = np.broadcast_to(sizes[None, None, :], (len(base_addrs), 2, len(runs))).ravel()
    return np.stack([addrs, lengths, np.full_like(addrs, device_id)], axis=1)


def _nixl_agent(name: str, progress_pause_us: int | None) -> Any:
    """A NIXL agent over UCX; ``progress_pause_us``: the pause of its progress thread between passes (None: NIXL's
    own, none). The Python wrapper offers no setting for it, so its config class is swapped for one that keeps
    the pause while the wrapper builds the agent."""
    from nixl_cu12 import _api

    if progress_pause_us is None:
        return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"]))
    bindings = _api.nixlBind
    base = bindings.nixlAgentConfig

    class PausedProgress(base):
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, progress_pause_us if key == "pthrDelay" else value)

    with _AGENT_BUILD:
        bindings.nixlAgentConfig = PausedProgress
        try:
            return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"]))
        finally:
            bindings.nixlAgentConfig = base


_AGENT_BUILD = threading.Lock()  # one agent built at a time while the config class is swapped
