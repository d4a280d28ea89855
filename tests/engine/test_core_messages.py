"""The engine-core messages round-trip every field; a bad frame is an error the loops can drop, never a crash."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.engine.core_messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineMessageType,
    Failure,
    Hello,
    Ready,
    RequestType,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
    parse_frames,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams


def _roundtrip(kind, message):
    return parse_frames([kind.value, encode(message)], type(kind))[1]


def test_add_request_with_every_sampling_field() -> None:
    params = SamplingParams(n=1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                            temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7, stop=["\n\n", "END"],
                            stop_token_ids=[5, 6], ignore_eos=True, max_tokens=33, min_tokens=2, logprobs=3,
                            prompt_logprobs=1, include_stop_str_in_output=True, skip_special_tokens=False,
                            spaces_between_special_tokens=False, logit_bias={11: -2.0, 12: 1.5},
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    req = EngineCoreRequest("req-1", [1, 2, 3], params, [2, 0], 33, 1234.5, cache_salt="tenant-a")
    back = _roundtrip(RequestType.ADD, req)
    assert back == req
    assert back.sampling_params == params
    assert back.sampling_params.structured_outputs.json == {"type": "object"}
    assert back.sampling_params.logit_bias == {11: -2.0, 12: 1.5}


@pytest.mark.parametrize("so", [StructuredOutputsParams(regex="[a-z]+"), StructuredOutputsParams(choice=["a", "b"]),
                                StructuredOutputsParams(grammar="root ::= \"x\""),
                                StructuredOutputsParams(json_object=True)])
def test_structured_output_kinds(so: StructuredOutputsParams) -> None:
    req = EngineCoreRequest("r", [1], SamplingParams(structured_outputs=so), [2], 4, 0.0)
    assert _roundtrip(RequestType.ADD, req).sampling_params.structured_outputs == so


def test_pooling_request() -> None:
    req = EngineCoreRequest("e", [101, 7, 102], SamplingParams(max_tokens=1), [], 1, 3.0,
                            pooling_params=PoolingParams(truncate_prompt_tokens=8, normalize=False, dimensions=32))
    assert _roundtrip(RequestType.ADD, req).pooling_params == PoolingParams(8, False, 32)


def test_outputs_with_stats_logprobs_and_utility() -> None:
    outs = EngineCoreOutputs(
        1, [EngineCoreOutput("a", [5, 6], new_logprobs=[{5: (-0.1, 1), 9: (-2.5, 2)}, {6: (-0.3, 1)}]),
            EngineCoreOutput("b", [], finish_reason="stop", stop_reason="###", num_cached_tokens=32,
                             prompt_logprobs=[{1: (-1.0, 1)}], pooling_output=b"\x00\x00\x80?")],
        SchedulerStats(engine_index=1, num_running=3, num_waiting=2, kv_cache_usage=0.25, num_steps=9,
                       step_tokens=40, num_preemptions=1, prefix_cache_queries=64, prefix_cache_hits=32,
                       spec_num_drafts=2, spec_accepted_per_pos=[2, 1], first_scheduled={"a": (10.0, 0.5)}),
        UtilityResult(4, {"k": [1, 2]}), timestamp=99.0)
    back = _roundtrip(EngineMessageType.OUTPUTS, outs)
    assert back == outs
    assert back.outputs[1].finished and not back.outputs[0].finished
    assert back.scheduler_stats.load == 5


@pytest.mark.parametrize("kind,message", [
    (RequestType.ABORT, AbortRequests(["a", "b"], "stop")),
    (RequestType.UTILITY, UtilityCall(3, "reset_prefix_cache", [])),
    (EngineMessageType.HELLO, Hello(0, 1234)),
    (EngineMessageType.READY, Ready(1, 512, 2048, None, 512, 64, 4, "cpu")),
    (EngineMessageType.FAILED, Failure(0, "RuntimeError: no")),
    (EngineMessageType.DEAD, Failure(1, "boom")),
])
def test_control_messages(kind, message) -> None:
    assert _roundtrip(kind, message) == message


def test_bad_frames_raise_errors_the_loops_catch() -> None:
    with pytest.raises(ValueError):
        parse_frames([b"?", b""], RequestType)  # unknown type
    with pytest.raises(ValueError):
        parse_frames([RequestType.ADD.value], RequestType)  # a frame missing
    with pytest.raises(msgspec.DecodeError):
        parse_frames([RequestType.ADD.value, b"\xc1garbage"], RequestType)
    with pytest.raises(msgspec.ValidationError):  # well-formed msgpack of the wrong shape
        decode(RequestType.ADD, encode(AbortRequests(["x"])))
