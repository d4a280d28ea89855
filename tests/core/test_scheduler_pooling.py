"""Pooling requests in the scheduler: no sampling, finish when the prompt is computed; an encoder keeps no KV
cache and never chunks a prompt; a decoder's blocks are freed at finish."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


def _scheduler(encoder: bool, budget: int = 16, num_blocks: int = 32, max_model_len: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                     is_encoder_only=encoder),
                     CacheConfig(block_size=4, num_blocks=2 if encoder else num_blocks, prefix_caching_hash_seed=0))


def _pooling_request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), [], 1,
                   pooling_params=PoolingParams())


def _fake_pool(sched, out) -> ModelRunnerOutput:
    """Pool each request whose prompt is complete after this step (as the pooling runner does)."""
    result = ModelRunnerOutput(sampled_token_ids={})
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_computed_tokens >= req.num_prompt_tokens:
            result.pooler_output[rid] = [float(req.num_prompt_tokens)]
    return result


def test_encoder_requests_run_whole_without_kv_blocks():
    sched = _scheduler(encoder=True, budget=16)
    for rid, n in [("a", 10), ("b", 5), ("c", 12), ("d", 16)]:
        sched.add_request(_pooling_request(rid, n))
    done, steps = {}, []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        for o in sched.update_from_output(out, _fake_pool(sched, out)):
            assert o.finished and o.new_token_ids == [] and o.finish_reason == "stop"
            done[o.req_id] = o.pooling_output
    # No prompt is ever split, and each step stays within the budget.
    assert steps == [{"a": 10, "b": 5}, {"c": 12}, {"d": 16}]
    assert done == {"a": [10.0], "b": [5.0], "c": [12.0], "d": [16.0]}
    assert sched.kv.pool.num_free_blocks == 1 and not sched.kv.req_to_blocks


def test_encoder_rejects_prompts_over_max_len_but_allows_exactly_max_len():
    sched = _scheduler(encoder=True, budget=64, max_model_len=64)
    sched.check_fits(64, pooling=True)  # nothing is generated, so the whole context may be prompt
    with pytest.raises(ValueError, match="input: 65 tokens is too long"):
        sched.check_fits(65, pooling=True)


def test_decoder_pooling_chunks_and_frees_blocks_at_finish():
    sched = _scheduler(encoder=False, budget=8)
    req = _pooling_request("a", 20)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        outputs = sched.update_from_output(out, _fake_pool(sched, out))
        assert bool(outputs) == (sum(chunks) == 20)
    assert chunks == [8, 8, 4]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv.pool.num_free_blocks == 31  # every block back (null block excluded)


def test_pooling_requests_take_no_prefix_cache_hits():
    sched = _scheduler(encoder=False, budget=64)
    sched.add_request(_pooling_request("a", 20))
    out = sched.schedule()
    sched.update_from_output(out, _fake_pool(sched, out))
    sched.add_request(_pooling_request("b", 20))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 20}  # MEAN/CLS pooling needs every position recomputed
