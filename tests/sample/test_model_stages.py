"""The seams of the split sampler: the default stages know no model's rules, the runner puts a model's rules stage
first (batch and sampler alike), each stage files its own step state, and the drafter's draw is the sampler's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.sample.batch_state import SamplingBatch, build_sampling_metadata
from pagedllm.sample.draw import draw_drafts, greedy_tokens, inverse_cdf
from pagedllm.sample.metadata import StepState
from pagedllm.sample.sampler import Sampler
from pagedllm.sample.stages import default_stages
from pagedllm.sample.stages.distribution import TemperatureStep, TopKTopPStep
from pagedllm.sample.stages.penalties import LogitBiasStep
from pagedllm.sample.whisper_rules import WhisperDecodingRules, WhisperRulesStage, WhisperStepRules
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner

CPU = torch.device("cpu")
VOCAB = 64
EOS = 2
# A toy Whisper vocabulary: <|notimestamps|> 40, timestamps 41..63; 5 and 6 always suppressed, 7 at the start.
RULES = WhisperDecodingRules(VOCAB, EOS, (5, 6), (7,), 40, 10)


def test_default_stages_know_no_model_rules() -> None:
    assert "whisper_rules" not in [s.name for s in default_stages()]
    meta = build_sampling_metadata([SamplingParams(temperature=0)], [[]], [[1]], [None], [EOS], VOCAB, CPU)
    assert meta.steps == {}


def test_the_runner_puts_a_model_rules_stage_first_in_batch_and_sampler() -> None:
    runner = ModelRunner(nn.Identity(), CPU, torch.float32, 16, VOCAB, [EOS])
    assert "whisper_rules" not in [s.name for s in runner.sampling.stages]
    stage = WhisperRulesStage(RULES)
    runner.add_model_rules_stage(stage)
    assert runner.sampling.stages[0] is stage and runner.sampler.stages is runner.sampling.stages
    assert [s.name for s in runner.sampling.stages[1:]] == [s.name for s in default_stages()]
    runner.sampling.update(added=[("r", SamplingParams(), [1], [], None)])
    with pytest.raises(RuntimeError, match="requests"):
        runner.add_model_rules_stage(WhisperRulesStage(RULES))


def test_the_rules_stage_rules_rows_without_allowed_tokens_only() -> None:
    batch = SamplingBatch(VOCAB, [EOS], CPU, [WhisperRulesStage(RULES), *default_stages()])
    batch.update(added=[("free", SamplingParams(temperature=0), [1], [], None),
                        ("named", SamplingParams(temperature=0, allowed_token_ids=[5, 7]), [1], [], None)])
    meta = batch.metadata(["named", "free"])
    state = meta.steps["whisper_rules"]
    assert isinstance(state, WhisperStepRules) and state.suppress_rows.tolist() == [1]
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = logits[:, 7] = 10.0  # the best tokens are the ones the rules suppress
    processed = Sampler(batch.stages).process_logits(logits, meta)
    assert processed[1, [5, 6, 7]].isinf().all()  # suppressed, begin-suppressed
    assert processed[0, [5, 7]].isfinite().all()  # the caller named them: the rules stay out
    assert batch.metadata(["named"]).steps.keys() == {"allowed_token_ids"}


def test_each_stage_files_its_own_step_state() -> None:
    params = [SamplingParams(temperature=0.8, top_k=4, logit_bias={3: 1.0}), SamplingParams(temperature=0)]
    meta = build_sampling_metadata(params, [[], []], [[1], [1]], [None, None], [EOS], VOCAB, CPU)
    steps = meta.steps
    assert steps.keys() == {"logit_bias", "temperature", "top_k_top_p"}
    assert isinstance(steps["logit_bias"], LogitBiasStep) and steps["logit_bias"].rows.tolist() == [0]
    assert isinstance(steps["temperature"], TemperatureStep) and steps["temperature"].temperature is meta.temperature
    top = steps["top_k_top_p"]
    assert isinstance(top, TopKTopPStep) and top.top_k.tolist() == [4, VOCAB] and top.top_p is None
    sampler = Sampler()
    assert [s.name for s in sampler.active_stages(meta)] == ["logit_bias", "temperature", "top_k_top_p"]


def test_step_states_compare_their_tensors_by_dtype_and_value() -> None:
    a = TopKTopPStep(torch.tensor([1, 2]), None, 2, False)
    assert a == TopKTopPStep(torch.tensor([1, 2]), None, 2, False)
    assert a != TopKTopPStep(torch.tensor([1, 3]), None, 2, False)
    assert a != TopKTopPStep(torch.tensor([1, 2], dtype=torch.int32), None, 2, False)
    assert a != TopKTopPStep(None, None, 2, False)
    assert TemperatureStep(torch.ones(2)) != MinP(torch.ones(2))


class MinP(StepState):
    def __init__(self, min_p: torch.Tensor) -> None:
        self.min_p = min_p


def test_drafts_draw_greedy_rows_by_argmax_and_seeded_rows_from_their_generator() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    tokens, probs = draw_drafts(logits, [0.0, 0.0, 0.0], [None] * 3)
    assert probs is None and torch.equal(tokens, greedy_tokens(logits))

    temperatures = [0.0, 0.7, 1.3]
    tokens, probs = draw_drafts(logits, temperatures, [None, torch.Generator().manual_seed(5),
                                                       torch.Generator().manual_seed(6)])
    assert probs.shape == (3, VOCAB) and probs.dtype == torch.float32
    for row in (1, 2):
        want = (logits[row] / temperatures[row]).softmax(dim=0)
        torch.testing.assert_close(probs[row], want)
        u = torch.rand(1, generator=torch.Generator().manual_seed(5 + row - 1), dtype=torch.float64)
        assert tokens[row] == inverse_cdf(probs[row:row + 1], u.reshape(1, 1))[0]
    assert tokens[0] == logits[0].argmax()
    again, _ = draw_drafts(logits, temperatures, [None, torch.Generator().manual_seed(5),
                                                  torch.Generator().manual_seed(6)])
    assert torch.equal(again, tokens)


def test_a_batch_with_the_rules_stage_gathers_what_a_fresh_one_does() -> None:
    """The rules stage keeps per-slot state like any other: a persistent batch equals a one-off batch."""
    stages = [WhisperRulesStage(RULES), *default_stages()]
    batch = SamplingBatch(VOCAB, [EOS], CPU, stages)
    rng = np.random.default_rng(0)
    outputs = {r: [41 + int(rng.integers(0, 5))] for r in ("a", "b")}
    batch.update(added=[(r, SamplingParams(temperature=0), [1], outputs[r], None) for r in ("a", "b")])
    got = batch.metadata(["b", "a"])
    want = build_sampling_metadata([SamplingParams(temperature=0)] * 2, [outputs["b"], outputs["a"]], [[1], [1]],
                                   [None, None], [EOS], VOCAB, CPU,
                                   stages=[WhisperRulesStage(RULES), *default_stages()])
    assert got.steps == want.steps and "whisper_rules" in got.steps
