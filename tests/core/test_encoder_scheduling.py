"""Encoder-decoder requests in the scheduler: encoder work counted against the step's budget, running decodes
first, a cross-attention KV cache group of fixed size per request that comes back when requests end."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

ENCODER = 1500
BLOCK = 16
CROSS_BLOCKS = -(-ENCODER // BLOCK)  # 94


def make_scheduler(budget: int = 2048, cross_requests: int = 8, max_seqs: int = 16) -> Scheduler:
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False, num_blocks=512,
                        cross_group_tokens=ENCODER, cross_group_num_blocks=cross_requests * CROSS_BLOCKS + 1)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=448,
                                     encoder_tokens_per_request=ENCODER), cache)


def audio_request(rid: str, max_tokens: int = 5) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(rid, [50257, 50362], params, eos_token_ids=[], max_tokens=max_tokens, encoder_input=object())


def step(sched: Scheduler):
    """One step with a model that samples token 7 for every request that caught up."""
    out = sched.schedule()
    sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
               if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def test_new_audio_takes_only_the_budget_running_decodes_leave() -> None:
    sched = make_scheduler(budget=2048)
    for i in range(4):
        sched.add_request(audio_request(str(i), max_tokens=6))
    new_per_step = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        running_decodes = [r for r, n in out.num_scheduled_tokens.items() if n == 1]
        new = [n.req_id for n in out.scheduled_new_reqs]
        new_per_step.append(len(new))
        # Every request admitted earlier decoded in this step too: the new audio never displaced it.
        assert len(running_decodes) + len(new) == len(out.num_scheduled_tokens)
        assert all(n.encoder_input is not None for n in out.scheduled_new_reqs)
        assert out.total_num_scheduled_tokens + ENCODER * len(new) <= 2048 or len(out.num_scheduled_tokens) == 1
    assert new_per_step[:4] == [1, 1, 1, 1]  # 1500 encoder positions + prompt: one new audio per 2048-token step
    assert sched.kv.usage == 0.0 and sched.kv.groups[1].pool.usage == 0.0


def test_a_bigger_budget_admits_several_encoders_in_one_step() -> None:
    sched = make_scheduler(budget=8192)
    for i in range(6):
        sched.add_request(audio_request(str(i)))
    out, _ = step(sched)
    assert len(out.scheduled_new_reqs) == 5  # 5 x (1500 + 2) <= 8192 < 6 x 1502


def test_an_encoder_larger_than_the_budget_still_runs_alone() -> None:
    sched = make_scheduler(budget=1000)
    sched.add_request(audio_request("a", max_tokens=3))
    sched.add_request(audio_request("b", max_tokens=3))
    out, _ = step(sched)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    out, _ = step(sched)  # "a" decodes: "b" must wait for a step with room, or for an empty one
    assert out.num_scheduled_tokens == {"a": 1}
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv.groups[1].pool.usage == 0.0


def test_cross_group_holds_the_encoder_positions_and_limits_admission() -> None:
    sched = make_scheduler(budget=100_000, cross_requests=3)
    for i in range(5):
        sched.add_request(audio_request(str(i), max_tokens=4))
    out, outputs = step(sched)
    assert len(out.scheduled_new_reqs) == 3  # the cross group holds three requests' encoder outputs
    for new in out.scheduled_new_reqs:
        assert len(new.block_ids[1]) == CROSS_BLOCKS and len(new.block_ids[0]) == 1
    finished = {o.req_id for o in outputs if o.finished}
    while sched.has_unfinished_requests():
        out, outputs = step(sched)
        assert all(not c.new_block_ids[1] for c in out.scheduled_cached_reqs)  # a cross table never grows
        finished |= {o.req_id for o in outputs if o.finished}
    assert finished == {str(i) for i in range(5)}
    assert sched.kv.groups[1].pool.num_free_blocks == sched.kv.groups[1].num_usable_blocks
    assert sched.kv.pool.num_free_blocks == sched.kv.num_usable_blocks


def test_preemption_frees_the_cross_blocks_and_reruns_the_encoder() -> None:
    sched = make_scheduler(budget=100_000, cross_requests=2)
    sched.kv.groups[0] = type(sched.kv.groups[0])(4, BLOCK, False)  # 3 decoder blocks: two requests cannot grow
    a, b = audio_request("a", max_tokens=40), audio_request("b", max_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    encoder_runs = {"a": 0, "b": 0}
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        for new in out.scheduled_new_reqs:
            encoder_runs[new.req_id] += 1
            assert new.num_computed_tokens == 0 and new.encoder_input is not None
    assert sched.num_preemptions > 0 and sum(encoder_runs.values()) > 2
    assert sched.kv.groups[1].pool.usage == 0.0
