"""An exception inside the model step fails only the request that causes it."""

from __future__ import annotations

from pagedllm import SamplingParams

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
