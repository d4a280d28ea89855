"""Prompt logprobs are computed a bounded number of positions at a time (model_runner.PROMPT_LOGPROBS_ROWS), so
a long prefill chunk never materializes [chunk tokens, vocab] logits at once (a GPU peak the KV sizing does
not profile); the entries must not depend on that slicing."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.worker import model_runner

# Runs the default model (the session's `llm`). Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow


def test_sliced_prompt_logprobs_equal_whole(llm: LLM, monkeypatch) -> None:
    prompt = {"prompt_token_ids": [1, 28, 3000, 412, 9, 77, 5120, 28, 640, 11, 902]}
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0)
    whole = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 3)
    sliced = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert len(sliced) == len(whole) == len(prompt["prompt_token_ids"]) and whole[0] is None
    for a, b in zip(whole[1:], sliced[1:]):
        assert a.keys() == b.keys()
        for token, entry in a.items():
            assert b[token].rank == entry.rank
            assert b[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
