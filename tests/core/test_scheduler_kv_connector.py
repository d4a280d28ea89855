"""The KV connector seam in the scheduler, with no model: remote prompts wait in WAITING_FOR_REMOTE_KVS while
others run, arrive into the right blocks (the fake runner's outputs depend on it), enter the prefix cache, a
producer holds blocks until read or timed out, failures recompute, and aborts never leak a block."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

from helpers.fake_connector import FakeConnector, step_with_connector
from helpers.fake_runner import FakeRunner, reference_output
from helpers.scheduler import make_scheduler

BS = 4


def _request(rid: str, prompt: list[int], max_tokens: int, params: dict | None = None) -> Request:
    extra = {"kv_transfer_params": params} if params else None
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, extra_args=extra)
    return Request(rid, prompt, sp, eos_token_ids=[], max_tokens=max_tokens)


def _setup(**kw):
    sched = make_scheduler(block_size=BS)
    runner = FakeRunner(sched.kv.pool.num_blocks, BS)
    connector = FakeConnector(runner, BS, **kw)
    sched.attach_kv_connector(connector)
    return sched, runner, connector


def _run(sched, runner, connector, max_steps: int = 200) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not sched.has_pending_kv_transfers():
            return outputs
        for o in step_with_connector(sched, runner, connector):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")


REMOTE = {"do_remote_prefill": True}


def test_remote_prompt_waits_while_others_run_then_decodes_correctly() -> None:
    sched, runner, connector = _setup(delay=3)
    prompt = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    remote = _request("remote", prompt, 5, REMOTE)
    local = _request("local", list(range(7)), 4)
    sched.add_request(remote)
    sched.add_request(local)
    first = step_with_connector(sched, runner, connector)
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(sched.kv.get_block_ids("remote")[0]) == 3  # blocks for the whole prompt, allocated up front
    assert "local" in {r.request_id for r in sched.running}
    outputs = _run(sched, runner, connector)
    assert outputs["remote"] == reference_output(prompt, 5)
    assert [t for o in first for t in o.new_token_ids] + outputs["local"] == reference_output(list(range(7)), 4)
    # The decode side computed only the last prompt token, and reports the rest as cached / transferred.
    assert remote.num_cached_tokens == len(prompt) - 1
    src = sched.prompt_tokens_by_source
    assert src["external_kv_transfer"] == len(prompt) - 1
    assert src["local_compute"] == 1 + 7
    assert sched.kv.usage == 0.0


def test_received_blocks_enter_the_prefix_cache() -> None:
    sched, runner, connector = _setup(delay=1)
    prompt = list(range(200, 213))
    sched.add_request(_request("remote", prompt, 2, REMOTE))
    _run(sched, runner, connector)
    again = _request("again", prompt, 3)
    sched.add_request(again)
    outputs = _run(sched, runner, connector)
    assert outputs["again"] == reference_output(prompt, 3)
    assert again.num_cached_tokens == 12  # three full received blocks hit locally
    assert sched.prompt_tokens_by_source["local_cache_hit"] == 12


def test_local_prefix_hit_is_not_transferred_again() -> None:
    sched, runner, connector = _setup(delay=1)
    prompt = list(range(300, 314))
    sched.add_request(_request("warm", prompt[:9], 1))
    _run(sched, runner, connector)
    remote = _request("remote", prompt, 3, REMOTE)
    sched.add_request(remote)
    outputs = _run(sched, runner, connector)
    assert outputs["remote"] == reference_output(prompt, 3)
    assert remote.num_local_hit_tokens == 8
    assert connector.num_loaded_tokens == len(prompt) - 8


def test_sync_load_counts_tokens_computed_in_the_same_step() -> None:
    sched, runner, connector = _setup(sync=True)
    prompt = list(range(400, 410))
    remote = _request("remote", prompt, 4, REMOTE)
    sched.add_request(remote)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"remote": 1}  # everything but the last token is loaded
    connector.bind_connector_metadata(out.kv_connector_metadata)
    connector.start_load_kv()
    result = runner.execute(out)
    result.kv_connector_output = connector.get_finished(set())
    outputs = {o.req_id: o.new_token_ids for o in sched.update_from_output(out, result)}
    outputs["remote"] += _run(sched, runner, connector)["remote"]
    assert outputs["remote"] == reference_output(prompt, 4)


def test_failed_transfer_falls_back_to_recompute() -> None:
    sched, runner, connector = _setup(delay=2, fail=True)
    prompt = list(range(500, 511))
    remote = _request("remote", prompt, 3, REMOTE)
    sched.add_request(remote)
    outputs = _run(sched, runner, connector)
    assert outputs["remote"] == reference_output(prompt, 3)
    assert sched.remote_kv.num_failed_transfers == 1
    assert sched.prompt_tokens_by_source["local_compute"] == len(prompt)
    assert sched.kv.usage == 0.0


def test_abort_while_receiving_holds_blocks_until_the_transfer_ends() -> None:
    sched, runner, connector = _setup(delay=4)
    remote = _request("remote", list(range(600, 611)), 3, REMOTE)
    sched.add_request(remote)
    step_with_connector(sched, runner, connector)
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.finish_requests(["remote"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv.usage > 0  # the blocks may still be written by the transfer
    _run(sched, runner, connector)
    assert sched.kv.usage == 0.0 and not sched.remote_kv.held and not sched.remote_kv.receiving


def test_abort_before_the_load_started_frees_everything() -> None:
    sched, runner, connector = _setup(delay=2)
    remote = _request("remote", list(range(700, 709)), 3, REMOTE)
    sched.add_request(remote)
    sched.schedule()  # allocated and waiting; the worker half never saw it
    connector._pending_loads.clear()
    sched.finish_requests(["remote"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.usage == 0.0 and not sched.has_pending_kv_transfers()


def test_producer_holds_blocks_until_read() -> None:
    sched, runner, connector = _setup()
    prompt = list(range(800, 810))
    sched.add_request(_request("p", prompt, 1, {"do_remote_decode": True}))
    finals = []
    for _ in range(3):
        finals += [o for o in step_with_connector(sched, runner, connector) if o.finished]
    assert len(finals) == 1 and finals[0].kv_transfer_params["remote_block_ids"]
    assert len(finals[0].kv_transfer_params["remote_block_ids"]) == 3
    assert sched.kv.usage > 0 and sched.has_pending_kv_transfers()
    connector.read("p")
    step_with_connector(sched, runner, connector)
    assert sched.kv.usage == 0.0 and not sched.has_pending_kv_transfers()


def test_producer_frees_unread_blocks_after_the_timeout() -> None:
    sched, runner, connector = _setup(timeout_steps=5)
    sched.add_request(_request("p", list(range(900, 906)), 1, {"do_remote_decode": True}))
    _run(sched, runner, connector)
    assert sched.kv.usage == 0.0


def test_a_remote_request_at_the_head_does_not_block_the_queue_for_memory() -> None:
    sched, runner, connector = _setup(delay=50)
    sched.add_request(_request("remote", list(range(1000, 1011)), 2, REMOTE))
    for i in range(4):
        sched.add_request(_request(f"l{i}", [i] * 6, 3))
    outputs = {}
    for _ in range(20):
        for o in step_with_connector(sched, runner, connector):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert all(outputs[f"l{i}"] == reference_output([i] * 6, 3) for i in range(4))
    rest = _run(sched, runner, connector)
    assert rest["remote"] == reference_output(list(range(1000, 1011)), 2)
