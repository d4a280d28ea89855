"""An exception inside the model step fails only the request that causes it."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams

# Runs the default model (the session's `llm`). Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

POISON = 49_000  # a token id the patched model refuses; greedy decoding of these prompts never emits it


def test_poisoned_request_fails_alone_and_the_rest_match_solo_runs(llm, monkeypatch) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    good = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i, 400 + i]} for i in range(4)]
    solo = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in good]

    model = llm.engine.core.worker.runner.model
    forward = model.forward

    def refusing_forward(input_ids, positions):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("cannot compute this token")
        return forward(input_ids, positions)

    monkeypatch.setattr(model, "forward", refusing_forward)
    bad = {"prompt_token_ids": [5, 6, POISON, 7]}
    outputs = llm.generate(good[:2] + [bad] + good[2:], params, use_tqdm=False)
    assert outputs[2].outputs[0].finish_reason == "error" and outputs[2].finished
    assert [o.outputs[0].token_ids for i, o in enumerate(outputs) if i != 2] == solo
    monkeypatch.undo()
    # The engine keeps serving, and its KV blocks all came back.
    again = llm.generate(good[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == solo[0]
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_usable_blocks


def test_a_broken_cuda_context_ends_the_engine_instead_of_failing_requests_one_by_one(llm, monkeypatch) -> None:
    """After a device-side assert every CUDA call fails: isolating requests would only fail each in turn while the
    server looked healthy. The error propagates (the server's engine loop then reports itself dead)."""
    import pytest

    from pagedllm.engine.engine_core import is_fatal_device_error

    model = llm.engine.core.worker.runner.model

    def broken_forward(input_ids, positions):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(model, "forward", broken_forward)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(RuntimeError, match="device-side assert"):
        llm.generate([{"prompt_token_ids": [100, 200, 300]}] * 2, params, use_tqdm=False)
    assert not llm.engine.core.scheduler._isolate  # no one-by-one retries were queued
    monkeypatch.undo()
    assert not is_fatal_device_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal_device_error(RuntimeError("cannot compute this token"))
    # The offline engine aborted the batch; it serves again once the context is fine (here: the patch is gone).
    assert llm.generate([{"prompt_token_ids": [100, 200, 300]}], params, use_tqdm=False)[0].finished
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_usable_blocks
