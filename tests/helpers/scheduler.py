"""Build a scheduler and drive it with the fake runner."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

from helpers.fake_runner import FakeRunner, reference_output


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   max_model_len: int = 256, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching, num_blocks=num_blocks,
                                 prefix_caching_hash_seed=0))


def make_request(rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(rid, prompt, params, eos_token_ids=[], max_tokens=max_tokens, cache_salt=salt)


def run_to_completion(sched: Scheduler, arrivals: dict[int, list[Request]] | None = None,
                      max_steps: int = 10_000) -> tuple[dict[str, list[int]], list]:
    """Returns outputs per request and the SchedulerOutputs of every step."""
    # The fake KV store lives as long as the scheduler, like a real cache.
    runner = sched.__dict__.setdefault("_fake_runner", FakeRunner(sched.kv.pool.num_blocks, sched.kv.block_size))
    arrivals = arrivals or {}
    outputs: dict[str, list[int]] = {}
    finish_reasons = sched.__dict__.setdefault("_finish_reasons", {})
    steps = []
    step = 0
    while step < max_steps:
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if not sched.has_unfinished_requests() and step > max(arrivals, default=0):
            break
        out = sched.schedule()
        steps.append(out)
        result = runner.execute(out)
        for o in sched.update_from_output(out, result):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                finish_reasons[o.req_id] = o.finish_reason
        step += 1
    else:
        raise AssertionError("scheduler did not finish")
    return outputs, steps


def random_arrivals(sched: Scheduler, reqs: list[tuple[int, int, int, int]], max_model_len: int = 64
                    ) -> tuple[dict[int, list[Request]], dict[str, list[int]]]:
    """Hypothesis-drawn ``(arrival step, prompt length, max_tokens, family)`` tuples -> (requests by arrival
    step, each request's expected output). Requests of one family share a prompt prefix, so prefix caching gets
    exercised; a prompt the cache could never hold is left out."""
    arrivals: dict[int, list[Request]] = {}
    expected: dict[str, list[int]] = {}
    for i, (arrive, plen, max_tokens, family) in enumerate(reqs):
        prompt = [family * 50 + j for j in range(plen)]
        req = make_request(f"r{i}", prompt, max_tokens)
        try:
            sched.check_fits(len(prompt))
        except ValueError:
            continue
        arrivals.setdefault(arrive, []).append(req)
        expected[req.request_id] = reference_output(prompt, min(max_tokens, max_model_len - plen))
    return arrivals, expected
