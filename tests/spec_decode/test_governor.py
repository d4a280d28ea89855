"""The draft governor: drafting turns itself off where it measures slower, and outputs never change."""

from __future__ import annotations

import pytest
from conftest import ENGINE

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import governor
from pagedllm.spec_decode.config import parse_speculative_config
from pagedllm.spec_decode.governor import MIN_DRAFTED_STEPS, DraftGovernor, bucket_of
from pagedllm.spec_decode.spec_decoder import SpecDecoder


def _run(gov: DraftGovernor, steps: int, num_requests: int, drafted_tps: float, plain_tps: float) -> list[bool]:
    """Steps at a fixed batch size; each draws drafts when the governor says so, at the given rates."""
    decisions = []
    for _ in range(steps):
        drafting = gov.drafting(num_requests)
        decisions.append(drafting)
        gov.observe(num_requests, num_requests, num_requests / (drafted_tps if drafting else plain_tps), drafting)
    return decisions


def _replay(gov: DraftGovernor, accepted: list[int], plain_s: float = 0.010, drafted_s: float = 0.012,
            noisy: dict[int, float] | None = None) -> list[bool]:
    """One request decoding: step i, if it drafts, yields 1 + accepted[i] tokens in ``drafted_s`` (a plain step
    one token in ``plain_s``); ``noisy`` {step: seconds} overrides a step's time (the machine disturbed it)."""
    decisions = []
    for i, extra in enumerate(accepted):
        drafting = gov.drafting(1)
        decisions.append(drafting)
        seconds = (noisy or {}).get(i, drafted_s if drafting else plain_s)
        gov.observe(1, 1 + extra if drafting else 1, seconds, drafting)
    return decisions


def test_buckets_are_powers_of_two() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 200)] == [1, 2, 4, 4, 8, 8, 16, 256]


def test_a_slow_start_before_copying_keeps_drafting_on() -> None:
    """An answer whose first 60 steps accept nothing, then copies (4 of 4 drafts accepted): drafting stays on."""
    gov = DraftGovernor()
    decisions = _replay(gov, [0] * 60 + [4] * 300)
    assert gov.num_turned_off == 0
    assert decisions[-50:].count(True) >= 48  # only the probes run without drafts


def test_bimodal_acceptance_is_judged_by_total_throughput() -> None:
    """Seven steps in ten accept nothing and three accept all four drafts: the median step is slower than a plain
    one, but the tokens per second over the window are 1.8x: drafting stays on."""
    gov = DraftGovernor()
    _replay(gov, [0, 0, 4, 0, 0, 4, 0, 0, 4, 0] * 50)
    assert gov.num_turned_off == 0


def test_one_disturbed_step_does_not_turn_drafting_off() -> None:
    gov = DraftGovernor()
    accepted = [1, 0, 1, 0] * 100  # 1.25x plain: a modest win
    _replay(gov, accepted, noisy={100: 2.0, 101: 1.5})  # two steps 150x slower than the rest
    assert gov.num_turned_off == 0


def test_drafting_that_never_accepts_turns_off_then_backs_off() -> None:
    gov = DraftGovernor(cooldown_steps=128, max_cooldown_steps=512)
    decisions = _replay(gov, [0] * 200)
    assert gov.num_turned_off == 1
    off_at = max(i for i, d in enumerate(decisions) if d) + 1
    assert decisions[:off_at].count(True) >= MIN_DRAFTED_STEPS  # judged on enough evidence
    decisions = decisions + _replay(gov, [0] * 1000)
    # Runs of steps without drafts longer than a probe: the cooldowns, doubling after each loss in a row.
    gaps, run = [], 0
    for drafting in decisions[off_at:]:
        if drafting:
            if run > 1:
                gaps.append(run)
            run = 0
        else:
            run += 1
    assert gaps[:3] == [128 + 1, 256, 512]  # the cooldowns (the first judged at a probe step: one more)
    assert gov.num_turned_off == 3 and gov.decisions[1, "on"] == 3  # the last retry still being judged
    assert gov.buckets[1].cooldown == 512  # capped at max_cooldown_steps


def test_a_losing_drafter_stops_early_under_load() -> None:
    """Eight requests a step: each step holds eight requests' evidence, so the judgement comes within 40 steps
    (an eighth of the answer), not after the answer."""
    gov = DraftGovernor()
    decisions = _run(gov, 120, 8, drafted_tps=700.0, plain_tps=1000.0)
    assert gov.num_turned_off == 1
    off_at = max(i for i, d in enumerate(decisions) if d) + 1
    assert off_at <= 40 and not any(decisions[off_at:])


def test_a_retry_that_pays_resets_the_cooldown() -> None:
    gov = DraftGovernor(cooldown_steps=64)
    _replay(gov, [0] * 150)  # off
    _replay(gov, [0] * 64)  # waits out the cooldown
    _replay(gov, [4] * 200)  # retried: now the text copies
    assert gov.num_turned_off == 1
    assert gov.buckets[1].enabled and gov.buckets[1].cooldown == 0


def test_drafting_that_pays_stays_on_with_probes() -> None:
    gov = DraftGovernor(probe_every=8)
    decisions = _run(gov, 200, 4, drafted_tps=150.0, plain_tps=100.0)
    assert gov.num_turned_off == 0
    assert decisions.count(False) == 200 // 8  # one plain step in eight keeps the other rate measured


def test_loss_within_tolerance_keeps_drafting() -> None:
    gov = DraftGovernor(max_loss=0.10, probe_every=4)
    _run(gov, 400, 1, drafted_tps=95.0, plain_tps=100.0)  # 5% slower: not worth a decision on noisy timings
    assert gov.num_turned_off == 0


def test_batch_size_buckets_are_judged_apart() -> None:
    gov = DraftGovernor(probe_every=4)
    _run(gov, 200, 1, drafted_tps=200.0, plain_tps=100.0)  # pays alone
    _run(gov, 100, 16, drafted_tps=500.0, plain_tps=1000.0)  # costs in a large batch
    assert gov.drafting(16) is False
    assert any(gov.drafting(1) for _ in range(3))
    assert gov.decision_counts() == {"16:off": 1}


def test_auto_disable_false_always_drafts() -> None:
    gov = DraftGovernor(enabled=False)
    assert all(_run(gov, 100, 2, drafted_tps=10.0, plain_tps=100.0))
    assert gov.num_turned_off == 0


def test_config_key() -> None:
    base = {"method": "ngram", "num_speculative_tokens": 3}
    assert parse_speculative_config(base).auto_disable is True
    assert parse_speculative_config({**base, "auto_disable": False}).auto_disable is False
    with pytest.raises(ValueError, match="auto_disable"):
        parse_speculative_config({**base, "auto_disable": "no"})


def _slow_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic timings: a step that verified drafts takes 4x a plain step, whatever the machine does."""
    real = SpecDecoder.observe_step

    def observe(self, num_requests, num_tokens, seconds, verified, rows):
        real(self, num_requests, num_tokens, 2.0 if verified else 0.5, verified, rows)

    monkeypatch.setattr(SpecDecoder, "observe_step", observe)


@pytest.mark.parametrize("auto_disable", [True, False])
def test_engine_turns_a_losing_drafter_off_and_outputs_stay_equal(tiny_models, monkeypatch, auto_disable) -> None:
    _slow_drafts(monkeypatch)
    cfg = {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 3, "auto_disable": auto_disable}
    plain = LLM(tiny_models["target"], **ENGINE)
    llm = LLM(tiny_models["target"], **ENGINE, speculative_config=cfg)
    decoder = llm.engine.core.worker.runner.spec_decoder
    decoder.governor.probe_every = 4  # plain samples sooner than 1 in 32
    decoder.budget = None  # the governor alone (the draft budget has its own tests)
    monkeypatch.setattr(governor, "MIN_DRAFTED_STEPS", 8)  # judged within one short answer
    prompts = [{"prompt_token_ids": [5, 17, 300, 42]}]  # one stream: every decode step in one batch-size bucket
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ids == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.core.scheduler.spec_stats
    drafts_before = stats.num_drafts
    assert drafts_before > 0
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == ids
    if auto_disable:
        assert stats.num_auto_disabled == 1
        assert stats.num_drafts == drafts_before  # off within the cooldown
    else:
        assert stats.num_auto_disabled == 0
        assert stats.num_drafts > drafts_before
