"""Whisper's decoding rules stage against transformers' logits processors, row by row, on random logits."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sample.whisper_rules import WhisperDecodingRules, apply_whisper_rules

VOCAB = 51864  # tiny.en: <|endoftext|> 50256, <|notimestamps|> 50362, <|0.00|> 50363 ... <|30.00|> 51863
EOS, NO_TS = 50256, 50362
TS = NO_TS + 1
SUPPRESS = (1, 2, 7, 50257, 50357, 50358, 50359, 50360, 50361)
BEGIN = (220, EOS)
RULES = WhisperDecodingRules(VOCAB, EOS, SUPPRESS, BEGIN, NO_TS, 50)

pytestmark = pytest.mark.slow  # imports transformers' generation stack (seconds on 2 shared cores)


def _reference(prompt: list[int], outputs: list[int], logits: torch.Tensor, timestamps: bool) -> torch.Tensor:
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    ids = torch.tensor([prompt + outputs])
    begin = len(prompt)
    scores = SuppressTokensAtBeginLogitsProcessor(list(BEGIN), begin)(ids, logits[None].clone())
    scores = SuppressTokensLogitsProcessor(list(SUPPRESS))(ids, scores)
    if timestamps:
        config = GenerationConfig(eos_token_id=EOS, no_timestamps_token_id=NO_TS, max_initial_timestamp_index=50)
        scores = WhisperTimeStampLogitsProcessor(config, begin)(ids, scores)
    return scores[0]


def _history(rng: random.Random) -> list[int]:
    """Outputs a model might have produced: text and timestamp pairs, sometimes a lone timestamp at the end."""
    out: list[int] = []
    t = TS + rng.randrange(0, 40)
    for _ in range(rng.randrange(0, 4)):
        out += [t] + [rng.randrange(300, 40000) for _ in range(rng.randrange(1, 4))]
        t += rng.randrange(0, 60)
        out.append(t)
        if rng.random() < 0.5:
            out.append(t)
    if out and rng.random() < 0.3:
        out.append(rng.randrange(300, 40000))
    return out


def test_rules_equal_transformers_processors() -> None:
    rng = random.Random(0)
    prompts, outputs, flags = [], [], []
    for i in range(24):
        timestamps = i % 3 != 0
        prompts.append([50257] if timestamps else [50257, NO_TS])
        outputs.append(_history(rng) if i % 4 else [])
        flags.append(timestamps)
    torch.manual_seed(0)
    logits = torch.randn(24, VOCAB) * 3
    logits[::5, TS:TS + 200] += 6.0  # some rows where the timestamps' total probability wins
    step = RULES.step(list(range(24)), prompts, outputs, torch.device("cpu"))
    ours = apply_whisper_rules(logits.clone(), step)
    for i in range(24):
        expected = _reference(prompts[i], outputs[i], logits[i], flags[i])
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(expected)), i
        finite = ~torch.isinf(expected)
        torch.testing.assert_close(ours[i][finite], expected[finite])


def test_rows_outside_the_rules_are_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    step = RULES.step([1], [[50257]] * 3, [[], [], []], torch.device("cpu"))
    ours = apply_whisper_rules(logits.clone(), step)
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert torch.isinf(ours[1, list(SUPPRESS)]).all() and torch.isinf(ours[1, :TS]).all()  # first: a timestamp
