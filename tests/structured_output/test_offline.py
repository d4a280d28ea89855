"""Structured outputs through the offline LLM: every self-terminated output follows its constraint, batching
and n > 1 do not change that, bad constraints are a ValueError naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams

from helpers.schemas import PROMPT, SCHEMAS

# Runs the default model. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="64MiB", max_model_len=1024)


def so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so(json=schema))]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=so(json=schema))
               for s in range(3)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    ended = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert ended, [o.outputs[0].text for o in outs]
    for out in ended:
        jsonschema.validate(json.loads(out.text), schema)


def test_choice_regex_grammar_json_object(llm: LLM) -> None:
    choices = ["yes", "no", "maybe later"]
    cases = [
        (so(choice=choices), lambda t: t in choices),
        (so(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (so(grammar='root ::= "red" | "green" | "blue"'), lambda t: t in ("red", "green", "blue")),
        (so(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=7, max_tokens=40, structured_outputs=c)
                  for c, _ in cases]
        outs = llm.generate([PROMPT] * len(cases), params, use_tqdm=False)
        for (constraint, check), out in zip(cases, outs):
            completion = out.outputs[0]
            if constraint.kind != "json_object":  # short by construction: must end by itself
                assert completion.finish_reason == "stop", (constraint, completion.text)
            if completion.finish_reason == "stop":
                assert check(completion.text), (constraint, completion.text)


def test_mixed_batch_and_greedy_alone_equals_batched(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so(json=SCHEMAS["order"]))
    choice = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=so(choice=["left", "right"]))
    prompts = [PROMPT, "The capital of France is", PROMPT, "Once upon a time"]
    params = [constrained, free, choice, free]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    batched = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(batched[0].text), SCHEMAS["order"])
    assert batched[2].text in ("left", "right")


def test_n_greater_than_one_gives_each_child_a_matcher(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=60, structured_outputs=so(json=SCHEMAS["person"]))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for completion in out.outputs:
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), SCHEMAS["person"])
    assert llm.engine.structured_output.num_matchers() == 0  # finished requests drop their matcher


def test_chunked_prefill_and_preemption_keep_matchers_right() -> None:
    # A tiny cache and budget: prompts are chunked (no bitmask for partial rows) and requests get preempted
    # (recompute keeps the output tokens, so the matcher must keep its state).
    tight = LLM(kv_cache_memory="9MiB", max_num_batched_tokens=24, max_model_len=256)
    roomy = LLM(kv_cache_memory="64MiB", max_model_len=256)
    long_prompt = "<|im_start|>user\nDescribe a city with its location and tags, in JSON.<|im_end|>\n" \
                  "<|im_start|>assistant\n"
    params = SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=so(json=SCHEMAS["nested"]))
    prompts = [long_prompt + " " * i for i in range(12)]
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["nested"])


def test_failed_step_does_not_advance_matchers(llm: LLM, monkeypatch) -> None:
    poison = 49_000
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so(json=SCHEMAS["order"]))
    solo = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    model = llm.engine.core.worker.runner.model
    forward = model.forward

    def refusing_forward(input_ids, positions):
        if bool((input_ids == poison).any()):
            raise RuntimeError("cannot compute this token")
        return forward(input_ids, positions)

    monkeypatch.setattr(model, "forward", refusing_forward)
    bad = {"prompt_token_ids": [5, 6, poison, 7]}
    outs = llm.generate([PROMPT, bad], [params, SamplingParams(max_tokens=4)], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].token_ids == solo


def test_bad_constraints_are_value_errors_naming_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match="structured_outputs: exactly one of"):
        so(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one of"):
        so()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        so(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json"):
        so(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.nonsense"):
        SamplingParams(structured_outputs={"nonsense": 1})
    bad_schema = SamplingParams(structured_outputs=so(json={"type": "object", "properties": {"a": {"type": "x"}}}))
    with pytest.raises(ValueError, match=r"structured_outputs\.json: cannot be compiled"):
        llm.generate([PROMPT], bad_schema, use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: cannot be compiled"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=so(regex="(ab")), use_tqdm=False)
    # Nothing was queued and the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]}
    before = manager.num_compiles
    for _ in range(3):
        llm.generate([PROMPT], SamplingParams(max_tokens=8, structured_outputs=so(json=schema)), use_tqdm=False)
    assert manager.num_compiles == before + 1
