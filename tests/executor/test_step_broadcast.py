"""The step broadcast: one msgpack payload per step, the same ``SchedulerOutput`` on every subscribed rank (new,
running, resumed and finished requests, preemptions, drafts and grammar bitmask rows)."""

from __future__ import annotations

import threading

import numpy as np
import torch
import zmq

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.executor.step_broadcast import STEP, StepPublisher, StepSubscriber, decode_step, encode_step
from pagedllm.sampling_params import SamplingParams


def _step() -> SchedulerOutput:
    new = NewRequestData("new-1", [1, 2, 3, 4], [], SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=9),
                         ([1, 2],), 0)
    resumed = NewRequestData("resumed-2", [5, 6], [7, 8, 9], SamplingParams(temperature=0, max_tokens=4), ([3, 4],), 4)
    running = CachedRequestData("running-3", ([5],), 17)
    bitmask = np.full((2, 8), -1, dtype=np.int32)
    bitmask[1, 3] = 0b1011
    return SchedulerOutput([new, resumed], [running], {"new-1": 4, "resumed-2": 5, "running-3": 3}, 12,
                           finished_req_ids={"done-4", "done-5"}, preempted_req_ids={"gone-6"},
                           structured_output_request_ids=["new-1", "running-3"], grammar_bitmask=bitmask,
                           scheduled_spec_decode_tokens={"running-3": [40, 41]})


def _same(a: SchedulerOutput, b: SchedulerOutput) -> None:
    assert [(r.req_id, r.prompt_token_ids, r.output_token_ids, r.block_ids, r.num_computed_tokens)
            for r in a.scheduled_new_reqs] == [(r.req_id, r.prompt_token_ids, r.output_token_ids, r.block_ids,
                                                r.num_computed_tokens) for r in b.scheduled_new_reqs]
    for x, y in zip(a.scheduled_new_reqs, b.scheduled_new_reqs):
        assert (x.sampling_params.temperature, x.sampling_params.top_k, x.sampling_params.seed,
                x.sampling_params.max_tokens) == (y.sampling_params.temperature, y.sampling_params.top_k,
                                                  y.sampling_params.seed, y.sampling_params.max_tokens)
    assert [(r.req_id, r.new_block_ids, r.num_computed_tokens) for r in a.scheduled_cached_reqs] == \
        [(r.req_id, r.new_block_ids, r.num_computed_tokens) for r in b.scheduled_cached_reqs]
    assert a.num_scheduled_tokens == b.num_scheduled_tokens
    assert a.total_num_scheduled_tokens == b.total_num_scheduled_tokens
    assert a.finished_req_ids == b.finished_req_ids and a.preempted_req_ids == b.preempted_req_ids
    assert a.structured_output_request_ids == b.structured_output_request_ids
    assert a.scheduled_spec_decode_tokens == b.scheduled_spec_decode_tokens
    assert torch.equal(torch.as_tensor(a.grammar_bitmask), torch.as_tensor(b.grammar_bitmask))


def test_round_trip_keeps_every_field() -> None:
    sched = _step()
    _same(sched, decode_step(encode_step(sched)))


def test_every_rank_receives_the_same_step(tmp_path) -> None:
    ctx = zmq.Context()
    steps, answers = f"ipc://{tmp_path}/steps", f"ipc://{tmp_path}/answers"
    pub = StepPublisher(ctx, steps, answers)
    received: dict[int, SchedulerOutput] = {}

    def rank(r: int) -> None:
        sub = StepSubscriber(ctx, r, steps, answers)
        kind, message = sub.recv()
        assert kind == STEP
        received[r] = message
        sub.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3)]
    for t in threads:
        t.start()
    pub.wait_subscribed(3, 10.0, lambda: None)
    sched = _step()
    pub.send_step(sched)
    for t in threads:
        t.join(10)
    pub.close()
    ctx.term()
    assert sorted(received) == [1, 2, 3]
    for got in received.values():
        _same(sched, got)
    assert pub.num_steps == 1  # one encode and one send for all ranks
