"""A request whose grammar is still compiling waits (WAITING_FOR_GRAMMAR) without blocking the queue,
keeps its place, and runs once the engine marks it WAITING again."""

from __future__ import annotations

from pagedllm.core.request import RequestStatus

from helpers.fake_runner import FakeRunner
from helpers.scheduler import make_request, make_scheduler


def test_grammar_waiting_request_is_skipped_then_runs() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched.kv.pool.num_blocks, sched.kv.block_size)
    blocked = make_request("grammar", [1, 2, 3], max_tokens=2)
    free = make_request("free", [4, 5, 6], max_tokens=2)
    sched.add_request(blocked)
    blocked.status = RequestStatus.WAITING_FOR_GRAMMAR  # what StructuredOutputManager.add_request does
    sched.add_request(free)

    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"free"}
    assert list(sched.waiting) == [blocked] and blocked.status == RequestStatus.WAITING_FOR_GRAMMAR
    sched.update_from_output(out, runner.execute(out))

    blocked.status = RequestStatus.WAITING  # the grammar compiled
    out = sched.schedule()
    assert "grammar" in out.num_scheduled_tokens


def test_aborting_a_grammar_waiting_request_frees_it() -> None:
    sched = make_scheduler()
    req = make_request("g", [1, 2, 3], max_tokens=2)
    sched.add_request(req)
    req.status = RequestStatus.WAITING_FOR_GRAMMAR
    assert sched.finish_requests(["g"], RequestStatus.FINISHED_ABORTED) == [req]
    assert not sched.has_unfinished_requests()
