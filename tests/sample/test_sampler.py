import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.sample.batch_state import build_sampling_metadata
from pagedllm.sample.ops import apply_penalties
from pagedllm.sample.sampler import Sampler, compute_logprobs_for_targets
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 0


def make_meta(params, outputs=None, prompts=None, generators=None, eos=(EOS,), vocab=None):
    rows = len(params)
    return build_sampling_metadata(
        params,
        outputs if outputs is not None else [[] for _ in range(rows)],
        prompts if prompts is not None else [[] for _ in range(rows)],
        generators if generators is not None else [None] * rows,
        list(eos),
        vocab,
        CPU,
    )


def sample(logits, params, **kwargs):
    meta = make_meta(params, vocab=logits.shape[1], **kwargs)
    return Sampler()(logits, meta)


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_fast_path_flags_and_lazy_tensors():
    meta = make_meta([SamplingParams(temperature=0.0)] * 3, vocab=10)
    steps = meta.steps
    assert meta.all_greedy and "penalties" not in steps and "top_k_top_p" not in steps and "min_p" not in steps
    assert "logit_bias" not in steps and "min_tokens" not in steps and meta.max_num_logprobs is None
    assert meta.temperature is None and "penalties" not in steps  # no output/prompt token ids gathered
    meta = make_meta([SamplingParams(frequency_penalty=0.5), SamplingParams(top_k=3, logprobs=2),
                      SamplingParams(temperature=0, logprobs=5)], vocab=10)
    steps = meta.steps
    assert not meta.all_greedy and not meta.all_random and "penalties" in steps
    assert steps["penalties"].output_token_ids is not None and steps["penalties"].prompt_token_ids is None  # no rep.
    top = steps["top_k_top_p"]
    assert top.top_k.tolist() == [10, 3, 10] and top.top_p is None and top.max_top_k == 3
    assert meta.max_num_logprobs == 5 and meta.num_logprobs == [None, 2, 5]


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = sample(logits, params)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(dim=1))


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(64, 200)
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))


def test_top_k_with_top_p_sort_path():
    torch.manual_seed(3)
    logits = torch.randn(64, 200)
    out = sample(logits, [SamplingParams(top_k=1, top_p=0.9)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))


def test_top_p_tiny_equals_greedy():
    torch.manual_seed(4)
    logits = torch.randn(64, 200)
    out = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))


def test_top_k_restricts_support():
    torch.manual_seed(5)
    logits = torch.randn(1, 30).repeat(2000, 1)
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=4)] * 2000)
    allowed = set(logits[0].topk(4).indices.tolist())
    sampled = set(out.sampled_token_ids.tolist())
    assert sampled <= allowed and len(sampled) == 4


def test_min_p():
    torch.manual_seed(6)
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.0]]).repeat(4000, 1)
    out = sample(logits, [SamplingParams(min_p=0.3)] * 4000)
    probs = logits[0].softmax(0)
    allowed = {i for i in range(5) if probs[i] >= 0.3 * probs.max()}
    assert allowed == {0, 1, 4}
    assert set(out.sampled_token_ids.tolist()) == allowed
    out = sample(logits[:64], [SamplingParams(min_p=1.0)] * 64)
    assert (out.sampled_token_ids == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_softmax(temperature):
    torch.manual_seed(7)
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0, 0.3]])
    rows = 40000
    out = sample(logits.repeat(rows, 1), [SamplingParams(temperature=temperature)] * rows)
    freq = torch.bincount(out.sampled_token_ids, minlength=5).float() / rows
    expected = (logits[0] / temperature).softmax(0)
    # 40k draws: std of each frequency < 0.0025, so 0.015 is > 6 sigma.
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_p_distribution_renormalizes():
    torch.manual_seed(8)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    rows = 40000
    out = sample(logits.repeat(rows, 1), [SamplingParams(top_p=0.7)] * rows)
    freq = torch.bincount(out.sampled_token_ids, minlength=4).float() / rows
    # Smallest prefix reaching 0.7 is {0, 1}; renormalized to 0.625 / 0.375.
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015), freq


def _seeded_run(batch_builder, steps=5, vocab=64):
    """Run `steps` sampling steps; the seeded request's row index and its batch are set by batch_builder."""
    logits_gen = torch.Generator().manual_seed(123)
    request_gen = seeded(42)
    tokens = []
    for _ in range(steps):
        target_logits = torch.randn(1, vocab, generator=logits_gen)
        logits, params, generators, row = batch_builder(target_logits, request_gen)
        meta = make_meta(params, generators=generators, vocab=vocab)
        tokens.append(Sampler()(logits, meta).sampled_token_ids[row].item())
    return tokens


def test_seeded_row_independent_of_batch():
    target = SamplingParams(temperature=1.0, seed=42)

    def alone(t_logits, gen):
        return t_logits, [target], [gen], 0

    def batched(others, row):
        def build(t_logits, gen):
            params, gens = list(others), [None] * len(others)
            params.insert(row, target)
            gens.insert(row, gen)
            gens = [g if g is not None or p is target else (seeded(9) if p.seed is not None else None)
                    for g, p in zip(gens, params, strict=True)]
            rows = torch.randn(len(others), t_logits.shape[1])
            logits = torch.cat([rows[:row], t_logits, rows[row:]])
            return logits, params, gens, row
        return build

    reference = _seeded_run(alone)
    others_a = [SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    others_b = [SamplingParams(temperature=0.7, seed=9), SamplingParams(), SamplingParams(top_p=0.5),
                SamplingParams(temperature=0.0), SamplingParams(min_p=0.1)]
    assert _seeded_run(batched(others_a, 1)) == reference
    assert _seeded_run(batched(others_b, 3)) == reference
    assert _seeded_run(batched(others_b, 0)) == reference
    # A different seed should (overwhelmingly likely) give a different sequence.
    assert _seeded_run(lambda t, g: (t, [target], [seeded(43)], 0)) != reference


def test_penalties_match_hand_computation():
    vocab = 6
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.5, 0.0],
                           [1.0, -2.0, 0.5, 3.0, -0.5, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25),
              SamplingParams(temperature=0.0)]
    prompts = [[0, 1], [0, 1, 2]]
    outputs = [[3, 3, 4], [3]]
    meta = make_meta(params, outputs=outputs, prompts=prompts, vocab=vocab)
    penalized = logits.clone()
    state = meta.steps["penalties"]
    apply_penalties(penalized, state.output_token_ids, state.prompt_token_ids, state.presence_penalties,
                    state.frequency_penalties, state.repetition_penalties)

    expected = logits.clone()
    row = expected[0]
    for tok in set(prompts[0]) | set(outputs[0]):
        row[tok] = row[tok] / 2.0 if row[tok] > 0 else row[tok] * 2.0
    for tok in set(outputs[0]):
        row[tok] -= 0.5 * outputs[0].count(tok) + 0.25
    # Hand values: 0: 1/2, 1: -2*2, 3: 3/2 - 1 - 0.25, 4: -0.5*2 - 0.5 - 0.25.
    assert row.tolist() == [0.5, -4.0, 0.5, 0.25, -1.75, 0.0]
    assert torch.allclose(penalized, expected)

    # Through the sampler: greedy would pick 3, the penalties move it to token 0 (ties: first index).
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [0, 3]


def test_logit_bias_forces_token():
    torch.manual_seed(9)
    logits = torch.randn(4, 100)
    worst = logits.argmin(dim=1)
    params = [SamplingParams(temperature=t, logit_bias={str(int(worst[i])): 100})
              for i, t in enumerate([0.0, 1.0, 0.7, 0.0])]
    out = sample(logits, params)
    assert torch.equal(out.sampled_token_ids, worst)


def test_logit_bias_out_of_vocab_dropped():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logit_bias={7: 100.0})])
    assert out.sampled_token_ids.tolist() == [1]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]]).repeat(4, 1)  # EOS (0) is the argmax
    params = [SamplingParams(temperature=0.0, min_tokens=3),
              SamplingParams(temperature=0.0, min_tokens=3),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1], ignore_eos=True)]
    outputs = [[2, 2], [2, 2, 2], [2], [2]]
    out = sample(logits, params, outputs=outputs)
    # Row 0: still short, EOS masked. Row 1: reached min_tokens. Row 2: EOS and stop id masked.
    # Row 3: ignore_eos keeps EOS allowed, stop id still masked.
    assert out.sampled_token_ids.tolist() == [1, 0, 2, 0]


def test_min_tokens_random_never_emits_eos():
    torch.manual_seed(10)
    logits = torch.tensor([[3.0, 0.0, 0.0]]).repeat(500, 1)
    out = sample(logits, [SamplingParams(min_tokens=1)] * 500, eos=(0, 2))
    assert (out.sampled_token_ids == 1).all()


def test_logprobs_shape_ranks_and_values():
    torch.manual_seed(11)
    logits = torch.randn(5, 40)
    params = [SamplingParams(temperature=0.8, logprobs=3, repetition_penalty=1.3, seed=i) for i in range(4)]
    params.append(SamplingParams(temperature=0.0, logprobs=0, presence_penalty=1.0))
    outputs = [[1, 2, 3]] * 5
    out = sample(logits, params, outputs=outputs, generators=[seeded(i) for i in range(5)])
    lp = out.logprobs
    assert lp.token_ids.shape == (5, 4) and lp.logprobs.shape == (5, 4) and lp.ranks.shape == (5,)
    raw = torch.log_softmax(logits, dim=1)  # raw model logprobs, before penalties/temperature
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    top = raw.topk(3, dim=1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    order = raw.argsort(dim=1, descending=True)
    expected_ranks = [order[i].tolist().index(int(t)) + 1 for i, t in enumerate(out.sampled_token_ids)]
    assert lp.ranks.tolist() == expected_ranks


def test_compute_logprobs_for_targets():
    torch.manual_seed(12)
    logits = torch.randn(7, 30)
    targets = torch.randint(0, 30, (7,))
    lp = compute_logprobs_for_targets(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=1)
    assert lp.token_ids.shape == (7, 3)
    assert torch.equal(lp.token_ids[:, 0], targets)
    assert torch.allclose(lp.logprobs[:, 0], raw[torch.arange(7), targets])
    assert torch.allclose(lp.logprobs[:, 1:], raw.topk(2, dim=1).values)
    assert lp.ranks.tolist() == [int((raw[i] > raw[i, targets[i]]).sum()) + 1 for i in range(7)]
    assert compute_logprobs_for_targets(logits, targets, 0).token_ids.shape == (7, 1)


def _allowed(logits_row, temperature, top_k, top_p, min_p, token):
    """Independent necessary condition for `token` to survive top-k -> top-p -> min-p (ties tolerated)."""
    scaled = logits_row.double() / temperature
    vocab = scaled.numel()
    value = scaled[token]
    if not math.isfinite(float(value)):
        return False
    k = top_k if 0 < top_k < vocab else vocab
    if int((scaled > value).sum()) >= k:
        return False
    kth = scaled.topk(k).values[-1]
    kept = torch.where(scaled >= kth, scaled, torch.tensor(float("-inf"), dtype=torch.float64))
    probs = kept.softmax(0)
    if top_p < 1.0 and float(probs[probs > probs[token]].sum()) >= top_p + 1e-4:
        return False
    if float(probs[token]) < min_p * float(probs.max()) * (1 - 1e-4):
        return False
    return float(probs[token]) > 0.0


row_params = st.tuples(
    st.floats(0.05, 3.0),  # temperature
    st.integers(-1, 30),  # top_k
    st.floats(0.01, 1.0),  # top_p
    st.floats(0.0, 1.0),  # min_p
)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=24),
    first=row_params,
    second=row_params,
    seed=st.integers(0, 2**31 - 1),
)
def test_sampled_token_survives_filters(logits, first, second, seed):
    """Mixed batches too: rows alternate between two parameter sets (exercises every truncation path)."""
    row = torch.tensor(logits, dtype=torch.float32)
    rows = 8
    knobs = [first if i % 2 == 0 else second for i in range(rows)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed + i)
              for i, (t, k, p, m) in enumerate(knobs)]
    generators = [seeded(seed + i) for i in range(rows)]
    out = sample(row.repeat(rows, 1), params, generators=generators)
    for token, (t, k, p, m) in zip(out.sampled_token_ids.tolist(), knobs, strict=True):
        assert _allowed(row, t, k, p, m, token)


def test_mixed_truncation_rows_do_not_leak():
    """A top-k+top-p row next to an unfiltered row and a top-p-only row: each keeps its own support."""
    torch.manual_seed(13)
    logits = torch.linspace(1.0, 0.0, 20).unsqueeze(0)  # nearly flat, descending
    rows = 3000
    params = [SamplingParams(top_k=3, top_p=0.5), SamplingParams(), SamplingParams(top_p=0.3)] * (rows // 3)
    out = sample(logits.repeat(rows, 1), params).sampled_token_ids.view(-1, 3)
    assert set(out[:, 0].tolist()) == {0, 1}  # top-3 renormalized: first two reach 0.5
    assert len(set(out[:, 1].tolist())) == 20
    assert set(out[:, 2].tolist()) == set(range(5))  # mass before token 4 is 0.29 < 0.3
