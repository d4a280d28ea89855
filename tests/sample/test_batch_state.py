"""The runner's persistent sampling state: requests keep their slot's values from add to remove, every step
gathers the same metadata a fresh one-off batch of those rows would, and no step reads SamplingParams."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from pagedllm.sample.batch_state import SamplingBatch, StepRows, build_sampling_metadata
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 64
EOS = [2]


def assert_same(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f.name
        elif f.name == "generators":
            assert a.keys() == b.keys() and all(a[k] is b[k] for k in b), f.name
        else:
            assert a == b, f.name


def varied_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(6)
    if kind == 0:
        return SamplingParams(temperature=0.0)
    if kind == 1:
        return SamplingParams(temperature=0.7, top_k=rng.choice([0, 5, 80]), top_p=rng.choice([1.0, 0.9]))
    if kind == 2:
        return SamplingParams(temperature=1.0, min_p=0.1, logprobs=rng.randrange(3), seed=rng.randrange(99))
    if kind == 3:
        return SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2,
                              logit_bias={3: 1.5, 7: -2.0})
    if kind == 4:
        return SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[5, 9], frequency_penalty=0.3)
    return SamplingParams(temperature=0.5, allowed_token_ids=[1, 4, 6], ignore_eos=True, min_tokens=2)


def test_steps_over_a_changing_batch_equal_a_fresh_batch_of_the_same_rows() -> None:
    rng = random.Random(0)
    batch = SamplingBatch(VOCAB, EOS, CPU)
    live: dict[str, tuple[SamplingParams, list[int], list[int], torch.Generator | None]] = {}
    next_id = 0
    for _ in range(40):
        removed = [r for r in live if rng.random() < 0.25]
        for r in removed:
            del live[r]
        added = []
        for _ in range(rng.randrange(4)):
            params = varied_params(rng)
            gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            entry = (params, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))], [], gen)
            live[f"r{next_id}"] = entry
            added.append((f"r{next_id}", entry[0], entry[1], entry[2], entry[3]))
            next_id += 1
        batch.update(removed=removed, added=added)
        for _, _, outputs, _ in live.values():  # the runner appends each step's token to its own lists
            outputs.append(rng.randrange(VOCAB))
        order = list(live)
        rng.shuffle(order)
        if not order:
            continue
        got = batch.metadata(order)
        want = build_sampling_metadata([live[r][0] for r in order], [live[r][2] for r in order],
                                       [live[r][1] for r in order], [live[r][3] for r in order], EOS, VOCAB, CPU)
        assert_same(got, want)
    assert len(batch) == len(live)


def test_a_freed_slot_keeps_nothing_of_its_last_request() -> None:
    batch = SamplingBatch(VOCAB, EOS, CPU)
    biased = SamplingParams(temperature=0.8, top_k=4, logit_bias={3: 5.0}, min_tokens=5, presence_penalty=1.0,
                            allowed_token_ids=[3, 4], logprobs=2)
    batch.update(added=[("a", biased, [1], [], torch.Generator().manual_seed(1))])
    batch.update(removed=["a"], added=[("b", SamplingParams(temperature=0.0), [1], [], None)])
    meta = batch.metadata(["b"])
    assert meta.all_greedy and not {"logit_bias", "min_tokens", "penalties"} & meta.steps.keys()
    assert not {"top_k_top_p", "allowed_token_ids"} & meta.steps.keys() and meta.max_num_logprobs is None
    assert meta.generators == {} and "a" not in batch and "b" in batch


def test_verification_rows_see_the_drafts_before_them_as_outputs() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, presence_penalty=1.0)
    batch = SamplingBatch(VOCAB, EOS, CPU)
    outputs = [7]
    batch.update(added=[("r", params, [1, 2], outputs, None)])
    meta = batch.metadata(["r", "r", "r"], pending=[[], [11], [11, 12]])
    # Row 0 sees 1 output (< min_tokens: EOS masked), rows 1-2 see 2 and 3 (not masked).
    steps = meta.steps
    assert steps["min_tokens"].rows.tolist() == [0] and steps["min_tokens"].tokens.tolist() == EOS
    assert steps["penalties"].output_token_ids.tolist() == [[7, VOCAB, VOCAB], [7, 11, VOCAB], [7, 11, 12]]
    assert outputs == [7]  # the runner's list is never extended by verification


def test_steps_read_no_sampling_params() -> None:
    """Each stage writes a request's values once, when it joins: a step touches no SamplingParams field."""

    class Watched(SamplingParams):
        reads = 0
        watching = False

        def __getattribute__(self, name: str):
            if not name.startswith("_") and type(self).watching:
                type(self).reads += 1
            return super().__getattribute__(name)

    params = [Watched(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5, logit_bias={3: 1.0},
                      min_tokens=4, logprobs=1, seed=3), Watched(temperature=0.0, allowed_token_ids=[1, 2])]
    batch = SamplingBatch(VOCAB, EOS, CPU)
    batch.update(added=[(f"r{i}", p, [1, 2], [], torch.Generator().manual_seed(i)) for i, p in enumerate(params)])
    Watched.watching = True
    try:
        meta = batch.metadata(["r1", "r0", "r0"], pending=[[], [], [5]])
    finally:
        Watched.watching = False
    assert Watched.reads == 0
    assert {"logit_bias", "min_tokens"} <= meta.steps.keys() and meta.steps["top_k_top_p"].top_k is not None  # used


def test_bad_step_inputs_name_the_field() -> None:
    batch = SamplingBatch(VOCAB, EOS, CPU)
    batch.update(added=[("r", SamplingParams(), [1], [], None)])
    with pytest.raises(ValueError, match="grammar_bitmask"):
        batch.metadata(["r"], grammar_rows=[0], grammar_bitmask=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="pending"):
        batch.metadata(["r"], pending=[[], []])


def test_a_stage_finds_the_steps_rows_that_use_it() -> None:
    batch = SamplingBatch(VOCAB, EOS, CPU)
    bias = next(s for s in batch.stages if s.name == "logit_bias")
    batch.update(added=[("plain", SamplingParams(), [1], [], None),
                        ("biased", SamplingParams(logit_bias={3: 1.0}), [1], [], None)])

    def rows(req_ids):
        slots = [batch._slot_of[r] for r in req_ids]
        step = StepRows(np.asarray(slots, dtype=np.int64), [[]] * len(slots), [[1]] * len(slots), VOCAB, CPU)
        got = bias.used_rows(step)
        return None if got is None else got.tolist()

    assert rows(["plain", "biased", "biased"]) == [1, 2]
    assert rows(["plain"]) is None
    batch.update(removed=["biased"])
    assert not bias.using and rows(["plain"]) is None
    batch.update(added=[("again", SamplingParams(), [1], [], None)])  # takes the freed slot: in use no more
    assert rows(["again", "plain"]) is None
