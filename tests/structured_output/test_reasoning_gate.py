"""The reasoning gate: which tokens reach the grammar, when the budget forces the end marker, and (offline, on
the default model) that a budget ends the thinking and a JSON schema then holds for the answer alone."""

from __future__ import annotations

import json

import pytest

from pagedllm.sampling_params import ReasoningParams
from pagedllm.structured_output.reasoning_gate import ReasoningGate

END = [7, 8]  # a two-token end marker, so partial matches are exercised
START = [5]


def feed(gate: ReasoningGate, tokens: list[int]) -> list[int]:
    return [t for token in tokens for t in gate.accept(token)]


def test_answer_tokens_start_after_the_end_marker() -> None:
    gate = ReasoningGate(ReasoningParams(end_token_ids=END))
    assert feed(gate, [1, 7, 2, 7, 8]) == [] and gate.done
    assert gate.num_reasoning_tokens == 5
    assert feed(gate, [3, 4]) == [3, 4]


def test_start_marker_required_when_given() -> None:
    gate = ReasoningGate(ReasoningParams(end_token_ids=END, start_token_ids=START))
    assert feed(gate, [5, 1, 7, 8, 9]) == [9] and gate.num_reasoning_tokens == 3
    no_think = ReasoningGate(ReasoningParams(end_token_ids=END, start_token_ids=START))
    assert feed(no_think, [1, 2]) == [1, 2] and no_think.done  # no reasoning: all answer


def test_budget_forces_the_end_marker_token_by_token() -> None:
    gate = ReasoningGate(ReasoningParams(end_token_ids=END, thinking_token_budget=3))
    assert feed(gate, [1, 2]) == [] and gate.forced_token() is None
    feed(gate, [3])
    assert gate.forced_token() == 7
    feed(gate, [7])
    assert gate.forced_token() == 8
    feed(gate, [8])
    assert gate.done and gate.forced_token() is None and feed(gate, [4]) == [4]


def test_budget_finishes_a_partly_written_marker_and_zero_budget_forces_at_once() -> None:
    gate = ReasoningGate(ReasoningParams(end_token_ids=END, thinking_token_budget=2))
    feed(gate, [1, 7])  # the budget runs out right after the marker's first token
    assert gate.forced_token() == 8
    zero = ReasoningGate(ReasoningParams(end_token_ids=END, thinking_token_budget=0))
    assert zero.forced_token() == 7


def test_bad_budget_names_the_field() -> None:
    with pytest.raises(ValueError, match="thinking_token_budget"):
        ReasoningParams(end_token_ids=END, thinking_token_budget=-1)


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    return LLM(kv_cache_memory="64MiB", max_model_len=512)


@pytest.mark.slow
def test_budget_then_schema_on_the_default_model(llm) -> None:
    from pagedllm import SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

    end_ids = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema),
                            reasoning=ReasoningParams(end_token_ids=end_ids, thinking_token_budget=6))
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    out, free = llm.generate(["The capital of France is"] * 2, [params, plain], use_tqdm=False)
    ids = out.outputs[0].token_ids
    # The first 6 tokens are the model's own (as without any constraint), then the forced marker, then JSON.
    assert ids[:6] == free.outputs[0].token_ids
    assert ids[6:6 + len(end_ids)] == end_ids
    answer = out.outputs[0].text.split("</think>", 1)[1]
    assert out.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(answer)["answer"], int)


def test_half_written_start_marker_is_finished_and_first_token_may_open_it() -> None:
    gate = ReasoningGate(ReasoningParams(end_token_ids=END, start_token_ids=[5, 6]))
    assert gate.opening_token() == 5 and gate.forced_token() is None
    feed(gate, [5])
    assert gate.opening_token() is None and gate.forced_token() == 6
    feed(gate, [6])
    assert gate.state == "thinking" and gate.forced_token() is None


def test_manager_rows_forced_and_opening_tokens() -> None:
    """The bitmask rows the manager builds for thinking requests (no model: a stand-in backend)."""
    import torch

    from pagedllm.structured_output.manager import StructuredOutputManager

    class Backend:
        def fill_bitmask(self, matchers, bitmask):
            bitmask.fill_(0)  # these grammars allow nothing: only the gate's own bits show

        def allocate_bitmask(self, rows):
            return torch.full((rows, 2), -1, dtype=torch.int32)

    manager = object.__new__(StructuredOutputManager)
    manager.backend = Backend
    forced_row = manager._fill([object()], Backend().allocate_bitmask(2), forced=[33], extra={0: 31})
    assert forced_row[0].tolist() == [-(1 << 31), 0]  # the matcher's row plus token 31 (the sign bit)
    assert forced_row[1].tolist() == [0, 2]  # only token 33


@pytest.mark.slow
def test_start_marker_opens_thinking_before_a_grammar(llm) -> None:
    """qwen3-style: the first token may open <think> (besides the grammar's own tokens); once opened the rest of
    the marker is forced, the budget ends the thinking and the grammar holds for the answer. Steered with a
    logit bias on the marker's first token: pushed up, the thinking path is taken; pushed down, the answer
    starts at once."""
    from pagedllm import SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

    tok = llm.get_tokenizer()
    start, end = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    reasoning = ReasoningParams(end_token_ids=end, start_token_ids=start, thinking_token_budget=3)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=choice, reasoning=reasoning,
                             logit_bias={start[0]: bias}) for bias in (100.0, -100.0)]
    thinks, answers = llm.generate(["Is the sky blue?"] * 2, params, use_tqdm=False)
    ids = thinks.outputs[0].token_ids
    assert ids[:len(start)] == start and ids[len(start) + 3:len(start) + 3 + len(end)] == end
    assert thinks.outputs[0].text.split("</think>", 1)[1] in ("yes", "no")
    assert thinks.outputs[0].finish_reason == "stop"
    assert answers.outputs[0].text in ("yes", "no") and answers.outputs[0].finish_reason == "stop"
