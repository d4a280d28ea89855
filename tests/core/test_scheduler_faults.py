"""A model step that raises costs only the request that breaks it; the engine keeps going."""

from __future__ import annotations

from pagedllm.core.scheduler import MAX_FAILED_STEPS, Scheduler

from helpers.fake_runner import FakeRunner, reference_output
from helpers.scheduler import make_request, make_scheduler

POISON = 999  # a token id the fake model cannot compute


class PoisonRunner(FakeRunner):
    """Raises on any step that computes POISON, after scribbling over the step's K/V slots (a half-written
    cache: nothing from a failed step may be reused)."""

    def execute(self, sched):
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.state.pop(rid, None)
        poisoned = False
        for new in sched.scheduled_new_reqs:
            tokens = new.prompt_token_ids + new.output_token_ids
            start = new.num_computed_tokens
            poisoned |= POISON in tokens[start:start + sched.num_scheduled_tokens[new.req_id]]
        if poisoned:
            bs = self.block_size
            for new in sched.scheduled_new_reqs:
                start, n = new.num_computed_tokens, sched.num_scheduled_tokens[new.req_id]
                for pos in range(start, start + n):
                    self.kv[new.block_ids[0][pos // bs] * bs + pos % bs] = -7
            raise RuntimeError("the model cannot compute this token")
        return super().execute(sched)


def drive(sched: Scheduler, runner: FakeRunner, arrivals: dict[int, list]) -> tuple[dict, dict, int]:
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    failures = 0
    step = 0
    while step < 1000:
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if not sched.has_unfinished_requests() and step > max(arrivals):
            break
        out = sched.schedule()
        try:
            result = runner.execute(out)
        except RuntimeError:
            failures += 1
            produced = sched.recover_from_failed_step(out)
        else:
            produced = sched.update_from_output(out, result)
        for o in produced:
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.req_id] = o.finish_reason
        step += 1
    else:
        raise AssertionError("did not finish")
    return outputs, reasons, failures


def test_only_the_poisoned_request_fails_and_nothing_leaks():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    runner = PoisonRunner(64, 4)
    prefix = list(range(1, 13))  # three full blocks, cached when allocated
    good = {f"r{i}": [50 + i] * 6 for i in range(3)}
    arrivals = {0: [make_request(rid, p, 5) for rid, p in good.items()]
                + [make_request("bad", prefix + [POISON, 7], 5)],
                # Arrives after the failure and shares the poisoned request's first three blocks: it must
                # not be served the scribbled K/V from the failed step.
                6: [make_request("late", prefix + [5, 6], 5)]}
    outputs, reasons, failures = drive(sched, runner, arrivals)
    assert reasons["bad"] == "error" and outputs.get("bad", []) == []
    for rid, prompt in good.items():
        assert reasons[rid] == "length" and outputs[rid] == reference_output(prompt, 5)
    assert outputs["late"] == reference_output(prefix + [5, 6], 5)
    assert failures == 2  # once in the batch, once alone
    assert sched.kv.pool.num_free_blocks == sched.kv.num_usable_blocks


def test_a_fault_that_needs_the_whole_batch_ends_after_bounded_retries():
    class BatchFault(FakeRunner):  # fails whenever two requests share a step, never alone
        def execute(self, sched):
            if len(sched.num_scheduled_tokens) > 1:
                for rid in sched.finished_req_ids | sched.preempted_req_ids:
                    self.state.pop(rid, None)
                raise RuntimeError("batch-dependent fault")
            return super().execute(sched)

    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    arrivals = {0: [make_request("a", [1, 2, 3], 4), make_request("b", [4, 5, 6], 4)]}
    outputs, reasons, failures = drive(sched, BatchFault(64, 4), arrivals)
    assert set(reasons) == {"a", "b"}  # both end, one way or the other: no endless retry loop
    assert failures <= 2 * MAX_FAILED_STEPS
    assert sched.kv.pool.num_free_blocks == sched.kv.num_usable_blocks
