"""Async output processing (on by default on GPUs): a step's outputs are detokenized while the device runs the
next step. It must change nothing a client sees but the moment: same tokens, same text, same stop strings,
same streamed deltas. On the CPU the switch is forced on, which exercises the same code path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.output_processor import OutputKind

from helpers.prompts import PROMPTS

# Runs the default model (the session's `llm`). Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow


@contextmanager
def async_output(llm: LLM, on: bool = True) -> Iterator[None]:
    engine = llm.engine
    before, engine.async_output = engine.async_output, on
    try:
        yield
    finally:
        engine.async_output = before


def _texts_and_tokens(outputs) -> list[tuple[str, list[int], str | None]]:
    return [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]


def test_off_on_cpus(llm: LLM) -> None:
    assert llm.engine.async_output is False


def test_same_outputs_as_synchronous_processing(llm: LLM) -> None:
    """Varied lengths (requests finish in different steps), a stop string, EOS allowed, n=2 sampling."""
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 7, ignore_eos=i % 3 == 0) for i in range(len(PROMPTS))]
    params[3] = SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"])
    params[5] = SamplingParams(temperature=0.8, max_tokens=9, n=2, seed=7)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    with async_output(llm):
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _texts_and_tokens(got) == _texts_and_tokens(want)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert got[3].outputs[0].finish_reason == want[3].outputs[0].finish_reason
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.scheduler.kv.usage == 0.0  # the stopped request's blocks were freed too


def test_processing_runs_inside_the_next_step(llm: LLM) -> None:
    """The point of it: every step's outputs but the last are processed while the next step is in the runner."""
    engine = llm.engine
    runner, processor = engine.core.worker.runner, engine.output_processor
    in_step, calls = [False], []
    execute, process = runner.execute_model, processor.process_outputs

    def traced_execute(*args, **kwargs):
        in_step[0] = True
        try:
            return execute(*args, **kwargs)
        finally:
            in_step[0] = False

    def traced_process(outputs):
        calls.append(in_step[0])
        return process(outputs)

    runner.execute_model, processor.process_outputs = traced_execute, traced_process
    try:
        with async_output(llm):
            llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.execute_model, processor.process_outputs
    assert len(calls) >= 6 and all(calls[:-1]) and not calls[-1]


def test_streamed_deltas_add_up_to_the_text(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    with async_output(llm):
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(f"delta-{i}", prompt, params, kind=OutputKind.DELTA)
        text, tokens, finished = {}, {}, set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                text[out.request_id] = text.get(out.request_id, "") + out.outputs[0].text
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
                if out.finished:
                    finished.add(out.request_id)
    assert finished == {"delta-0", "delta-1"}
    assert [text[f"delta-{i}"] for i in range(2)] == [o.outputs[0].text for o in want]
    assert [tokens[f"delta-{i}"] for i in range(2)] == [list(o.outputs[0].token_ids) for o in want]


def test_an_error_while_processing_is_not_blamed_on_the_model(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in the output processor surfaces from step() as itself; the scheduler does not isolate the
    batch's requests as if the model step had failed."""
    engine = llm.engine
    with async_output(llm):
        engine.add_request("boom", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        engine.step()  # the prefill: its outputs wait for the next step

        def broken(outputs):
            raise RuntimeError("detokenizer broke")

        monkeypatch.setattr(engine.output_processor, "process_outputs", broken)
        with pytest.raises(RuntimeError, match="detokenizer broke"):
            engine.step()
        monkeypatch.undo()
        assert not engine.core.scheduler._isolate
        engine.abort_request(["boom"])
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.core.scheduler.kv.usage == 0.0
