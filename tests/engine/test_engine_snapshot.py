"""The snapshot publisher the engine loop runs for the playground's cache map (no model: a real scheduler
with the fake runner)."""

import json
from types import SimpleNamespace

from pagedllm.engine.engine_snapshot import SnapshotPublisher

from helpers.scheduler import make_request, make_scheduler


def fake_engine(num_blocks: int = 16):
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, budget=64)
    return SimpleNamespace(core=SimpleNamespace(scheduler=sched, num_steps=0))


def test_nothing_is_built_while_nobody_watches():
    engine = fake_engine()
    pub = SnapshotPublisher(min_interval_s=0.0)
    for _ in range(5):
        pub.after_step(engine, 0.01)
    pub.flush(engine)
    assert pub.latest is None and pub.is_stale()


def test_watched_steps_publish_at_most_every_interval():
    engine = fake_engine()
    pub = SnapshotPublisher(min_interval_s=60.0)
    pub.watch()
    pub.after_step(engine, 0.01)
    first = pub.latest
    assert first is not None and first.seq == 1
    for _ in range(10):
        pub.after_step(engine, 0.02)
    assert pub.latest is first  # within the interval: only marked dirty
    pub.flush(engine)  # the loop goes idle: the final state goes out
    assert pub.latest.seq == 2
    assert pub.latest.step_times.num_steps == 10 and abs(pub.latest.step_times.mean - 0.02) < 1e-9
    pub.flush(engine)
    assert pub.latest.seq == 2  # nothing changed since


def test_snapshot_reflects_requests_and_counters():
    engine = fake_engine()
    sched = engine.core.scheduler
    sched.add_request(make_request("a", list(range(10)), max_tokens=4))
    sched.add_request(make_request("b", list(range(50, 55)), max_tokens=4))
    sched.schedule()
    engine.core.num_steps = 1
    pub = SnapshotPublisher()
    snap = pub.publish(engine)
    body = snap.to_dict()
    assert body["scheduler"] == {"running": 2, "waiting": 0, "preemptions": 0, "steps": 1}
    assert [o["id"] for o in body["owners"]] == ["a", "b"]
    assert [o["status"] for o in body["owners"]] == ["running", "running"]
    assert [o["num_blocks"] for o in body["owners"]] == [3, 2]
    assert body["counts"]["used"] == 5 and body["counts"]["free"] == 10
    assert abs(body["kv_cache_usage"] - 5 / 15) < 1e-9
    assert sum(count for _, _, count in body["runs"]) == 16
    assert json.loads(snap.json_bytes) == body
    assert snap.json_bytes is snap.json_bytes  # encoded once


def test_a_failing_build_disables_the_view_but_not_the_loop():
    pub = SnapshotPublisher(min_interval_s=0.0)
    pub.watch()
    broken = SimpleNamespace(core=None)
    pub.after_step(broken, 0.01)  # must not raise into the engine loop
    assert pub.publish(broken) is None and pub.latest is None
