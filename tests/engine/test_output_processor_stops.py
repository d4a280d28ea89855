"""A request ended by a stop string while the engine core already ran its next steps: the outputs of several
steps can reach the front end in one batch, and the tokens past the stop must not count the request finished a
second time (it then never finished: a non-streamed request hung until its client timed out)."""

from __future__ import annotations

import os

import pytest

from pagedllm import SamplingParams
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.output_processor import OutputKind, OutputProcessor

from helpers.model_helpers import default_model_path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", [OutputKind.FINAL_ONLY, OutputKind.DELTA])
def test_a_stop_then_later_steps_in_one_batch_finish_the_request_once(tokenizer, kind: OutputKind) -> None:
    processor = OutputProcessor(tokenizer)
    prompt = _ids(tokenizer, "1, 2, 3, 4,")
    processor.add_request("r", None, prompt, SamplingParams(max_tokens=12, stop=["6,"]), kind, 0.0)
    first, later = _ids(tokenizer, " 5, 6, 7"), _ids(tokenizer, ", 8, 9")
    outputs, to_stop = processor.process_outputs([EngineCoreOutput("r", first), EngineCoreOutput("r", later)])
    assert to_stop == ["r"]  # the engine must stop it
    assert len(outputs) == 1 and outputs[0].finished
    done = outputs[0].outputs[0]
    assert done.finish_reason == "stop" and done.stop_reason == "6,"
    assert done.text == " 5, "
    assert "r" not in processor.parents  # its state is gone: nothing leaks


def test_a_finished_child_of_several_ignores_its_later_steps(tokenizer) -> None:
    """n = 2: one child stops, the engine's next step for it arrives in a later batch beside its sibling's end."""
    processor = OutputProcessor(tokenizer)
    prompt = _ids(tokenizer, "1, 2, 3, 4,")
    processor.add_request("p", None, prompt, SamplingParams(n=2, max_tokens=12, stop=["6,"]),
                          OutputKind.FINAL_ONLY, 0.0)
    outputs, to_stop = processor.process_outputs([EngineCoreOutput("0_p", _ids(tokenizer, " 5, 6, 7"))])
    assert to_stop == ["0_p"] and outputs == []  # the sibling still runs
    outputs, _ = processor.process_outputs([EngineCoreOutput("0_p", _ids(tokenizer, ", 8")),
                                            EngineCoreOutput("1_p", _ids(tokenizer, " 5"), finish_reason="length")])
    assert len(outputs) == 1 and outputs[0].finished
    assert [c.finish_reason for c in outputs[0].outputs] == ["stop", "length"]
    assert outputs[0].outputs[0].text == " 5, "
