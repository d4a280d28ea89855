"""NixlConnector's worker halves over real NIXL (UCX, DRAM) with small caches, no model: a READ moves whole
blocks into the right slots and releases the producer's hold; a refused peer, a dead producer and an unknown
side channel fail the receive (the scheduler then recomputes); an abort before the READ releases at once; a
producer frees unread blocks after its timeout."""

from __future__ import annotations

import time

import pytest
import torch

from pagedllm.distributed.kv_transfer.base import KVConnectorOutput, KVConnectorRole
from pagedllm.distributed.kv_transfer.config import parse_kv_transfer_config
from pagedllm.distributed.kv_transfer.nixl import NixlConnector, NixlMetadata, RecvSpec

pytest.importorskip("nixl_cu12")

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 12, 4, 2, 8


def _worker(role: str, **extra) -> NixlConnector:
    config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": role,
                                       "kv_connector_extra_config": extra})
    conn = NixlConnector(config, KVConnectorRole.WORKER, BS)
    caches = [torch.zeros(2, BLOCKS, BS, HEADS, DIM) for _ in range(LAYERS)]
    if role == "kv_producer":
        for i, c in enumerate(caches):
            c.copy_(torch.randn_like(c) + i)
    conn.register_kv_caches(caches)
    return conn


def _step(conn: NixlConnector, meta: NixlMetadata | None = None, finished: set[str] | None = None
          ) -> KVConnectorOutput:
    conn.bind_connector_metadata(meta)
    conn.start_load_kv()
    out = conn.get_finished(finished or set())
    conn.clear_connector_metadata()
    return out


def _until(conn: NixlConnector, pred, timeout: float = 30.0, finished: set[str] | None = None) -> KVConnectorOutput:
    total = KVConnectorOutput()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        total.merge(_step(conn, finished=finished))
        if pred(total):
            return total
        time.sleep(0.005)
    raise AssertionError(f"timed out; got {total}")


def _spec(prod: NixlConnector, local: list[int], remote: list[int], rid: str = "p-1", **kw) -> RecvSpec:
    return RecvSpec(local_block_ids=local, remote_block_ids=remote, remote_engine_id=prod.config.engine_id,
                    remote_host="127.0.0.1", remote_port=prod.side_channel_port, remote_request_id=rid, **kw)


@pytest.fixture
def pair():
    prod, cons = _worker("kv_producer"), _worker("kv_consumer")
    yield prod, cons
    prod.shutdown()
    cons.shutdown()


def test_read_moves_whole_blocks_and_releases_the_producer(pair) -> None:
    prod, cons = pair
    _step(prod, NixlMetadata(send={"p-1": [3, 5, 7]}))
    out = _step(cons, NixlMetadata(recv={"d-1": _spec(prod, [1, 2, 9], [3, 5, 7])}))
    out.merge(_until(cons, lambda o: "d-1" in o.finished_recving))
    assert not out.failed_recving
    for src, dst in zip(prod.kv_caches, cons.kv_caches):
        assert torch.equal(dst[:, [1, 2, 9]], src[:, [3, 5, 7]])
        assert not dst[:, [0, 3, 4]].any()  # nothing else was written
    _until(prod, lambda o: "p-1" in o.finished_sending)
    assert cons.num_blocks_received == 3
    # Consecutive ids on both sides move as one region per layer and half.
    _step(cons, NixlMetadata(recv={"d-2": _spec(prod, [4, 5, 6], [8, 9, 10], rid="p-2")}))
    _until(cons, lambda o: "d-2" in o.finished_recving)
    for src, dst in zip(prod.kv_caches, cons.kv_caches):
        assert torch.equal(dst[:, 4:7], src[:, 8:11]) and not dst[:, 7].any()


def test_abort_before_the_read_releases_the_producer_at_once() -> None:
    # A handshake slower than the default 5 s (a loaded CI machine) would leave the consumer unable to tell the
    # producer, which then frees only after its own timeout: give this pair a long one.
    prod, cons = _worker("kv_producer", handshake_timeout=60), _worker("kv_consumer", handshake_timeout=60)
    try:
        _step(prod, NixlMetadata(send={"p-1": [3]}))
        out = _step(cons, NixlMetadata(recv={"d-1": _spec(prod, [1], [3], cancelled=True)}))
        out.merge(_until(cons, lambda o: "d-1" in o.finished_recving))
        assert not cons.kv_caches[0].any() and not out.failed_recving
        _until(prod, lambda o: "p-1" in o.finished_sending)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_unconfigured_or_dead_peers_fail_the_receive(pair) -> None:
    prod, cons = pair
    bad_host = _spec(prod, [1], [3], rid="a")
    bad_host.remote_host = "10.1.2.3"  # not loopback and not in peers
    out = _step(cons, NixlMetadata(recv={"d-a": bad_host}))
    assert "d-a" in out.failed_recving
    dead = _spec(prod, [1], [3], rid="b")
    dead.remote_port = 1  # nobody listens there
    cons.handshake_timeout_s = 0.3
    started = time.monotonic()
    _step(cons, NixlMetadata(recv={"d-b": dead}))
    _until(cons, lambda o: "d-b" in o.failed_recving)
    assert time.monotonic() - started < 5
    wrong_engine = _spec(prod, [1], [3], rid="c")
    wrong_engine.remote_engine_id = "someone-else"
    _step(cons, NixlMetadata(recv={"d-c": wrong_engine}))
    _until(cons, lambda o: "d-c" in o.failed_recving)
    assert not cons.kv_caches[0].any()


def test_producer_refuses_engines_outside_peer_engine_ids() -> None:
    prod = _worker("kv_producer", peer_engine_ids=["decode-0"])
    cons = _worker("kv_consumer")
    try:
        _step(cons, NixlMetadata(recv={"d-1": _spec(prod, [1], [3])}))
        _until(cons, lambda o: "d-1" in o.failed_recving)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_producer_frees_unread_blocks_after_the_timeout() -> None:
    prod = _worker("kv_producer", abort_request_timeout=0.3)
    try:
        _step(prod, NixlMetadata(send={"p-1": [3]}))
        started = time.monotonic()
        _until(prod, lambda o: "p-1" in o.finished_sending)
        assert 0.25 < time.monotonic() - started < 3
    finally:
        prod.shutdown()


def test_consecutive_blocks_merge_into_one_region() -> None:
    from pagedllm.distributed.kv_transfer.nixl import block_runs

    assert block_runs([4, 5, 6, 9, 10], [1, 2, 3, 4, 5]) == [(4, 1, 3), (9, 4, 2)]
    assert block_runs([1, 2], [7, 3]) == [(1, 7, 1), (2, 3, 1)]
    assert block_runs([], []) == []


def test_an_idle_connector_leaves_the_cores_to_the_model() -> None:
    """NIXL's progress thread spins with no pause by default: one whole core per idle connector (5.0 s of CPU in
    5 s). Paused between passes, two idle connectors (a producer and a consumer after a transfer) use a few
    percent of one."""
    import resource

    prod, cons = _worker("kv_producer"), _worker("kv_consumer")
    try:
        _step(cons, NixlMetadata(recv={"p-1": _spec(prod, [1, 2], [3, 4])}))
        _until(cons, lambda o: "p-1" in o.finished_recving)  # handshake and READ done: both agents are wired up
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(2.0)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        assert cpu < 0.2 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s idle"
    finally:
        cons.shutdown()
        prod.shutdown()


def test_huge_page_advice_covers_the_caches_whole_pages() -> None:
    """The KV cache a connector registers is advised onto transparent huge pages (cheaper process_vm_readv)."""
    from pagedllm.platforms.cpu_memory import HUGE_PAGE, advise_huge_pages, zeroed_host_tensor

    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read()
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off in this kernel")
    cache = zeroed_host_tensor((2, 64, 16, 8, 64), torch.float32, huge_pages=True)  # 8 MiB, 2 MiB-aligned
    assert cache.data_ptr() % HUGE_PAGE == 0
    assert advise_huge_pages(cache)
    assert not advise_huge_pages(torch.zeros(16))  # no whole huge page inside: nothing to advise
    cache.fill_(1.0)  # fault the pages in: with THP they come as huge pages
    assert _anon_huge_kb(cache.data_ptr()) >= 4096


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_fp8_blocks_move_as_bytes_and_a_peer_with_other_scales_is_refused() -> None:
    """An fp8 cache's blocks move byte for byte between instances whose kv_format (dtype and every layer's k/v
    scales) agrees; a producer that stored with other scales fails the receive (the prompt is recomputed)."""
    def fp8_worker(role: str, kv_format: str) -> NixlConnector:
        config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": role})
        conn = NixlConnector(config, KVConnectorRole.WORKER, BS)
        caches = [torch.zeros(2, BLOCKS, BS, HEADS, DIM, dtype=torch.float8_e4m3fn) for _ in range(LAYERS)]
        if role == "kv_producer":
            for c in caches:
                c.copy_(torch.randn(c.shape).to(torch.float8_e4m3fn))
        conn.set_kv_format(kv_format)
        conn.register_kv_caches(caches)
        return conn

    same = "float8_e4m3fn:0.5/0.25,0.5/0.25,0.5/0.25"
    prod, cons, other = (fp8_worker("kv_producer", same), fp8_worker("kv_consumer", same),
                         fp8_worker("kv_consumer", same.replace("0.25", "0.125")))
    try:
        _step(prod, NixlMetadata(send={"p-1": [3, 5]}))
        _step(cons, NixlMetadata(recv={"d-1": _spec(prod, [1, 2], [3, 5])}))
        out = _until(cons, lambda o: "d-1" in o.finished_recving)
        assert not out.failed_recving
        for src, dst in zip(prod.kv_caches, cons.kv_caches):
            assert torch.equal(dst[:, [1, 2]].view(torch.uint8), src[:, [3, 5]].view(torch.uint8))
        _step(other, NixlMetadata(recv={"d-2": _spec(prod, [1], [3], rid="p-2")}))
        _until(other, lambda o: "d-2" in o.failed_recving)
        assert not other.kv_caches[0].view(torch.uint8).any()
    finally:
        for conn in (prod, cons, other):
            conn.shutdown()
