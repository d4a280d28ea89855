"""The xgrammar backend and the manager without a model: compile kinds and errors, the cache, the
WAITING_FOR_GRAMMAR hand-off, batched bitmask fill, matchers that follow only kept tokens."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine_args import EngineArgs
from pagedllm.model_executor.loader import load_tokenizer
from pagedllm.sample.ops import unpack_bitmask
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager, resolve_bitmask
from pagedllm.structured_output.params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EngineArgs().create_engine_config().model)


@pytest.fixture()
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, 49152, [2])
    yield m
    m.shutdown()


def _request(rid: str, so: StructuredOutputsParams) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=so), [2], 8)


def test_compile_errors_name_the_field_and_are_not_cached(manager) -> None:
    bad = StructuredOutputsParams(regex="(ab")
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: cannot be compiled: .*parenthesis"):
        manager.validate(bad)
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        manager.validate(StructuredOutputsParams(grammar="root ::= "))
    good = StructuredOutputsParams(choice=["a", "b"])
    manager.validate(good)
    manager.validate(StructuredOutputsParams(choice=["a", "b"]))  # same key: cached
    assert manager.num_compiles == 3
    with pytest.raises(ValueError):
        manager.validate(bad)  # a failure is retried, not remembered
    assert manager.num_compiles == 4


def test_waiting_for_grammar_then_bitmask_and_accept(manager, tokenizer) -> None:
    so = StructuredOutputsParams(choice=["yes", "no"])
    requests = {rid: _request(rid, so) for rid in ("a", "b")}
    for r in requests.values():
        manager.add_request(r)
        assert r.status == RequestStatus.WAITING_FOR_GRAMMAR
    manager.validate(so)
    assert manager.poll() == []
    assert all(r.status == RequestStatus.WAITING for r in requests.values())

    # "a" samples this step, "b" is a partial prefill chunk (no bitmask row).
    requests["a"].num_computed_tokens = 3
    requests["b"].num_computed_tokens = 1
    sched = SchedulerOutput([], [], {"a": 3, "b": 1}, 4)
    manager.fill_bitmask(sched, requests)
    assert sched.structured_output_request_ids == ["a"]
    allowed = unpack_bitmask(resolve_bitmask(sched.grammar_bitmask), 49152)[0].nonzero().flatten().tolist()
    first = tokenizer.encode("yes")[0]
    assert first in allowed and len(allowed) < 10

    # Only kept tokens move a matcher; a failed step would simply not call accept_tokens.
    yes = tokenizer.encode("yes")
    ended = set()
    for token in yes + [2]:
        ended = manager.accept_tokens(ModelRunnerOutput(sampled_token_ids={"a": [token]}))
    assert ended == {"a"}
    manager.remove_finished({"b": requests["b"]})
    assert manager.num_matchers() == 1


def test_batched_fill_equals_row_by_row(manager) -> None:
    backend = manager.backend()
    compiled = [backend.compile(StructuredOutputsParams(regex="[0-9]+").key()),
                backend.compile(StructuredOutputsParams(json={"type": "object"}).key())]
    matchers = [backend.new_matcher(compiled[i % 2]) for i in range(10)]
    batched = backend.allocate_bitmask(10)
    backend.fill_bitmask(matchers, batched)
    single = backend.allocate_bitmask(10)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(single, i)
    assert torch.equal(batched, single)


def test_fill_overwrites_every_word_of_a_reused_row(manager) -> None:
    # The manager reuses one bitmask buffer across steps: a fill must not depend on what was there before.
    backend = manager.backend()
    compiled = backend.compile(StructuredOutputsParams(json={"type": "object"}).key())
    for rows in (3, 12):  # the row-by-row path and xgrammar's batched path
        matchers = [backend.new_matcher(compiled) for _ in range(rows)]
        fresh = backend.allocate_bitmask(rows)
        backend.fill_bitmask(matchers, fresh)
        for garbage in (0, -1, 0x55555555):
            reused = torch.full_like(fresh, garbage)
            backend.fill_bitmask(matchers, reused)
            assert torch.equal(reused, fresh), (rows, garbage)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped_fill", "fill_before_forward"])
def test_overlapped_fill_equals_direct_fill_and_buffer_is_reused(tokenizer, overlap: bool) -> None:
    manager = StructuredOutputManager(tokenizer, 49152, [2], overlap_fill=overlap)
    try:
        specs = [StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="[0-9]{3}")]
        requests = {f"r{i}": _request(f"r{i}", specs[i % 2]) for i in range(10)}
        for r in requests.values():
            manager.add_request(r)
            r.num_computed_tokens = 3
        for so in specs:
            manager.validate(so)
        manager.poll()
        backend = manager.backend()
        seen = []
        for step in range(3):
            sched = SchedulerOutput([], [], {rid: 1 for rid in requests}, len(requests))
            manager.fill_bitmask(sched, requests)
            got = resolve_bitmask(sched.grammar_bitmask)
            expected = backend.allocate_bitmask(len(requests))
            for i, rid in enumerate(sched.structured_output_request_ids):
                manager._matchers[rid].fill_next_token_bitmask(expected, i)
            assert torch.equal(got, expected), step
            seen.append(got.data_ptr())
            digit = tokenizer.encode("7")[0]
            manager.accept_tokens(ModelRunnerOutput(sampled_token_ids={f"r{i}": [digit] for i in range(1, 10, 2)}))
        assert len(set(seen)) == 1, "one buffer serves every step"
    finally:
        manager.shutdown()


def test_fill_overlaps_the_forward_only_where_a_cpu_is_spare(monkeypatch) -> None:
    import os

    import pagedllm.structured_output.manager as manager_module

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpus)
    assert manager_module._cpu_is_spare() is False  # torch's threads use every CPU: fill before the forward
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpus - 1)
    assert manager_module._cpu_is_spare() is True
