"""The draft budget: drafts per request from recorded step costs and acceptance (no timing in these tests), and
greedy outputs unchanged when it caps drafts, alone and batched."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ENGINE

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import draft_budget
from pagedllm.spec_decode.draft_budget import PROBE_DRAFTS, PROBE_EVERY, DraftBudget, drafts_worth, expected_accepted
from pagedllm.spec_decode.spec_decoder import SpecDecoder


def _costs(budget: DraftBudget, num_requests: int, fixed: float, per_row: float, verify: float = 0.0,
           max_drafts: int = 16) -> None:
    """Recorded pure decode steps of ``num_requests`` requests with 0..max_drafts drafts each, on the line (a step
    that verifies drafts costs ``verify`` more)."""
    for i in range(4 * (max_drafts + 1)):
        rows = num_requests * (1 + i % (max_drafts + 1))
        budget.observe_step(num_requests, rows, rows > num_requests,
                            fixed + per_row * rows + verify * (rows > num_requests))


def _copying(budget: DraftBudget, req_id: str, steps: int = 10, k: int = 8) -> None:
    for _ in range(steps):
        budget.record(req_id, k, k)


def _rejecting(budget: DraftBudget, req_id: str, steps: int = 10, k: int = 4) -> None:
    for _ in range(steps):
        budget.record(req_id, k, 0)


def _rate(budget: DraftBudget, plan: dict[str, int], num_requests: int) -> float:
    """Predicted tokens per second of a step that drafts ``plan`` (proposing cost included)."""
    fixed, per_row, verify = budget.cost_line(num_requests)
    gain = num_requests + sum(expected_accepted(budget.alpha(r), d) for r, d in plan.items())
    drafting = sum(d > 0 for d in plan.values())
    cost = fixed + per_row * (num_requests + sum(plan.values())) + budget.proposer_seconds * drafting + (
        verify if drafting else 0.0)
    return gain / cost


def test_the_cost_line_fits_recorded_steps_and_clips_outliers() -> None:
    budget = DraftBudget()
    assert budget.cost_line(8) is None
    _costs(budget, 8, fixed=0.010, per_row=0.0004, verify=0.002)
    assert budget.cost_line(8) == pytest.approx((0.010, 0.0004, 0.002))
    for rows in range(8, 8 * 17, 8):  # steps the machine disturbed (other work only adds time)
        budget.observe_step(8, rows, rows > 8, 0.5)
    assert budget.cost_line(8) == pytest.approx((0.010, 0.0004, 0.002))
    assert budget.costs.get(1) is None  # buckets apart
    same = DraftBudget()
    for _ in range(40):
        same.observe_step(8, 8, False, 0.01)  # no spread in rows: no slope to trust
    assert same.cost_line(8) is None
    drafted_only = DraftBudget()  # no plain steps: verifying's own cost cannot be told apart from the fixed part
    for i in range(40):
        drafted_only.observe_step(1, 2 + i % 8, True, 0.004 + 0.001 * (2 + i % 8))
    assert drafted_only.cost_line(1) == pytest.approx((0.004, 0.001, 0.0))
    cheaper = DraftBudget()  # verifying steps cheaper than the line through plain steps: no negative cost
    for i in range(40):
        rows = 1 + i % 8
        cheaper.observe_step(1, rows, rows > 1, 0.006 + 0.001 * rows - 0.003 * (rows > 1))
    fixed, per_row, verify = cheaper.cost_line(1)
    assert verify == 0.0 and per_row >= 0.0 and 0.0 < fixed < 0.01


def test_verifying_at_all_costs_so_small_drafts_do_not_pay() -> None:
    """A step that verifies pays a fixed 4 ms on top of its rows: a request expected to accept about 0.7 tokens of
    one draft is planned none, though its one row alone would pay."""
    budget = DraftBudget()
    _costs(budget, 1, fixed=0.004, per_row=0.0001, verify=0.004)
    budget.record("a", 1, 1)
    budget.record("a", 1, 0)
    assert budget.plan({"a": 1}, 1) == {"a": 0}
    cheap = DraftBudget()
    _costs(cheap, 1, fixed=0.004, per_row=0.0001)
    cheap.record("a", 1, 1)
    cheap.record("a", 1, 0)
    assert cheap.plan({"a": 1}, 1) == {"a": 1}


def test_the_cost_line_holds_on_a_busy_machine() -> None:
    """A third of the steps slowed 2-20x at random (a machine shared with other work): the line stays within 15%
    of the undisturbed one."""
    rng = np.random.default_rng(1)
    budget = DraftBudget()
    for _ in range(400):
        rows = 1 + int(rng.integers(0, 17))
        seconds = 0.004 + 0.0006 * rows + 0.001 * (rows > 1)
        if rng.random() < 1 / 3:
            seconds *= rng.uniform(2, 20)
        budget.observe_step(1, rows, rows > 1, seconds)
    fixed, per_row, _ = budget.cost_line(1)
    assert per_row == pytest.approx(0.0006, rel=0.15) and fixed == pytest.approx(0.004, rel=0.15)


def test_drafts_worth_is_the_last_draft_still_above_the_threshold() -> None:
    assert drafts_worth(0.5, 0.2, 16) == 2  # 0.5, 0.25 > 0.2 >= 0.125
    assert drafts_worth(0.5, 0.25, 16) == 1  # strictly above
    assert drafts_worth(0.9, 0.0, 5) == 5 and drafts_worth(0.9, 0.95, 5) == 0 and drafts_worth(0.9, 0.1, 0) == 0
    for alpha in (0.3, 0.7, 0.95):
        for thr in (0.01, 0.2, 0.5):
            d = drafts_worth(alpha, thr, 100)
            assert (d == 0 or alpha ** d > thr) and alpha ** (d + 1) <= thr
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4.0 and expected_accepted(0.7, 0) == 0.0


def test_without_a_cost_line_requests_draft_a_few_and_a_near_batch_size_lends_its_line() -> None:
    budget = DraftBudget()
    assert budget.plan({"a": 16, "b": 3}, 2) == {"a": draft_budget.COLD_DRAFTS, "b": 3}
    _costs(budget, 1, fixed=0.004, per_row=0.0001)
    _costs(budget, 16, fixed=0.008, per_row=0.0009)
    assert budget.cost_line(2) == pytest.approx((0.004, 0.0001, 0.0))
    assert budget.cost_line(8) == pytest.approx((0.008, 0.0009, 0.0))


def test_cheap_rows_at_batch_1_draft_fully_for_a_copying_request() -> None:
    budget = DraftBudget()
    _costs(budget, 1, fixed=0.004, per_row=0.0001)  # weight-bound: 16 more rows cost 40% of a step
    _copying(budget, "a")
    assert budget.plan({"a": 16}, 1) == {"a": 16}


def test_a_larger_batch_drafts_fewer_tokens_for_the_same_acceptance() -> None:
    """The same requests' record, a batch-1 cost and a batch-8 cost (rows cost more than the batch's fixed part
    at 8): the plan at 8 is shorter, and at both the predicted rate beats not drafting."""
    budget = DraftBudget()
    _costs(budget, 1, fixed=0.004, per_row=0.0003)
    _costs(budget, 8, fixed=0.005, per_row=0.0008)
    ids = [f"r{i}" for i in range(8)]
    for rid in ids:  # 3 of 4 drafts accepted per step on average: alpha about 0.75 after a rejection
        for _ in range(6):
            budget.record(rid, 4, 3)
    alone = budget.plan({"r0": 16}, 1)["r0"]
    batched = budget.plan(dict.fromkeys(ids, 16), 8)
    assert 0 < max(batched.values()) < alone
    assert _rate(budget, {"r0": alone}, 1) > _rate(budget, {}, 1)
    assert _rate(budget, batched, 8) > _rate(budget, {}, 8)


def test_poor_acceptance_does_not_draft_while_good_acceptance_does() -> None:
    budget = DraftBudget()
    _costs(budget, 8, fixed=0.005, per_row=0.0008)
    good, poor = [f"g{i}" for i in range(4)], [f"p{i}" for i in range(4)]
    for rid in good:
        _copying(budget, rid)
    for rid in poor:
        _rejecting(budget, rid)
    plan = budget.plan(dict.fromkeys(good + poor, 16), 8)
    assert all(plan[r] == 0 for r in poor)
    assert all(plan[r] >= 4 for r in good)


def test_the_plan_never_predicts_a_loss() -> None:
    """Random acceptance records, costs and rooms: the plan's predicted rate is at least the plain rate, and at
    least that of drafting everything the rooms allow."""
    rng = np.random.default_rng(0)
    for trial in range(50):
        budget = DraftBudget()
        n = int(rng.integers(1, 9))
        _costs(budget, n, fixed=float(rng.uniform(0.002, 0.02)), per_row=float(rng.uniform(1e-5, 2e-3)),
               verify=float(rng.uniform(0, 3e-3)))
        budget.observe_proposer(float(rng.uniform(0, 2e-4)) * n, n)
        rooms = {}
        for i in range(n):
            rid = f"{trial}-{i}"
            for _ in range(int(rng.integers(0, 8))):
                k = int(rng.integers(1, 9))
                budget.record(rid, k, int(rng.integers(0, k + 1)))
            rooms[rid] = int(rng.integers(0, 17))
        plan = budget.plan(rooms, n)
        assert all(0 <= plan[r] <= rooms[r] for r in rooms)
        assert _rate(budget, plan, n) >= _rate(budget, {}, n) * (1 - 1e-9)
        assert _rate(budget, plan, n) >= _rate(budget, rooms, n) * (1 - 1e-9)


def test_a_full_acceptance_lengthens_the_next_draft() -> None:
    """Acceptance is bimodal: a request that just accepted all its drafts is planned longer drafts than one
    that just rejected some."""
    budget = DraftBudget()
    _costs(budget, 1, fixed=0.004, per_row=0.0006)
    for _ in range(5):  # copies runs (all accepted), then meets new text and rejects for a few steps
        for accepted in (8, 8, 8, 8, 2):
            budget.record("a", 8, accepted)
        for _ in range(3):
            budget.record("a", 4, 0)
    after_reject = budget.plan({"a": 16}, 1)["a"]
    budget.record("a", 4, 4)
    after_full = budget.plan({"a": 16}, 1)["a"]
    assert after_full > after_reject


def test_a_request_planned_none_probes_now_and_then() -> None:
    budget = DraftBudget()
    _costs(budget, 8, fixed=0.005, per_row=0.002)
    _rejecting(budget, "p", steps=20)
    plans = [budget.plan({"p": 16}, 8)["p"] for _ in range(2 * PROBE_EVERY)]
    assert plans.count(PROBE_DRAFTS) == 2 and plans.count(0) == 2 * PROBE_EVERY - 2
    budget.forget("p")
    assert "p" not in budget.requests


# ---- in the engine ------------------------------------------------------------------------------------

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42, 5, 17, 300, 42, 5, 17]},
           {"prompt_token_ids": [9, 8, 7, 6]},
           {"prompt_token_ids": [100, 200, 100, 200, 100, 200, 100]},
           {"prompt_token_ids": [33, 44, 55, 66, 77]}]


def _ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_outputs_unchanged_when_the_budget_caps_drafts(tiny_models, monkeypatch) -> None:
    """Deterministic step costs where rows are dear (each row a third of a one-request step): the budget plans
    fewer drafts than k, some requests none, and the outputs equal those without speculation, alone and
    batched."""
    real = SpecDecoder.observe_step

    def observe(self, num_requests, num_tokens, seconds, verified, rows):
        real(self, num_requests, num_tokens, 0.003 + 0.001 * rows + self.propose_seconds, verified, rows)

    monkeypatch.setattr(SpecDecoder, "observe_step", observe)
    monkeypatch.setattr(draft_budget, "MIN_COST_STEPS", 4)
    plans: list[dict[str, int]] = []
    real_plan = draft_budget.DraftBudget.plan

    def spy(self, rooms, num_requests):
        plan = real_plan(self, rooms, num_requests)
        if self.cost_line(num_requests) is not None:
            plans.append(plan)
        return plan

    monkeypatch.setattr(draft_budget.DraftBudget, "plan", spy)
    plain = LLM(tiny_models["target"], **ENGINE)
    suffix = LLM(tiny_models["target"], **ENGINE, speculative_config=SUFFIX)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = _ids(plain, PROMPTS, params)
    assert [_ids(suffix, [p], params)[0] for p in PROMPTS] == expected
    assert _ids(suffix, PROMPTS, params) == expected
    planned = [d for plan in plans for d in plan.values()]
    assert planned and min(planned) < SUFFIX["num_speculative_tokens"]
    assert suffix.engine.core.scheduler.spec_stats.num_drafts > 0
