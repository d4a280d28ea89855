"""The sampler as an ordered list of stages: every draw path honours the grammar bitmask, masked rows never
produce a token outside the mask or a NaN, and process_logits + draw agree with forward."""

from __future__ import annotations

import pytest
import torch

import pagedllm.sample.sampler as sampler_module
from pagedllm.platforms import platform_for
from pagedllm.sample.batch_state import build_sampling_metadata
from pagedllm.sample.ops import unpack_bitmask
from pagedllm.sample.sampler import Sampler
from pagedllm.sample.stages import GrammarBitmaskStage, TemperatureStage, default_stages
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 300


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [M, V] bool -> [M, ceil(V/32)] int32 in xgrammar's layout (bit j of word w = token 32w+j)."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = (1 << torch.arange(32, dtype=torch.int64))
    packed = (padded.view(rows, words, 32) * weights).sum(dim=2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def make_meta(params, grammar_rows=None, allowed=None, generators=None):
    rows = len(params)
    return build_sampling_metadata(
        params, [[] for _ in range(rows)], [[] for _ in range(rows)],
        generators if generators is not None else [None] * rows, [0], VOCAB, CPU,
        grammar_rows=grammar_rows, grammar_bitmask=None if allowed is None else pack_bitmask(allowed))


DRAW_MODES = ["fused_cpp", "cpp_draw", "torch_draw"]


def use_draw(mode: str, monkeypatch) -> None:
    """fused_cpp: the grammar bitmask read inside the C++ draw; cpp_draw: -inf fill, then the C++ draw;
    torch_draw: -inf fill, then torch ops."""
    if mode != "fused_cpp":
        monkeypatch.setattr(sampler_module, "masked_draw_kernel", lambda *a, **k: None)
    if mode == "torch_draw":
        monkeypatch.setattr(platform_for("cpu"), "cpu_kernels", lambda dtype, dtypes=(torch.float32,): None)


def adversarial(rows: int, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [rows, V] where every disallowed token beats every allowed one by far."""
    torch.manual_seed(rows)
    logits = torch.randn(rows, VOCAB)
    return torch.where(allowed, logits - 30.0, logits + 30.0)


def test_unpack_matches_pack() -> None:
    allowed = torch.rand(5, VOCAB) < 0.3
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), VOCAB), allowed)


def test_stage_order_and_activity() -> None:
    names = [s.name for s in default_stages()]
    # Whisper's rules are no default stage: the worker puts them first for a Whisper model (test_model_stages.py).
    assert names == ["allowed_token_ids", "logit_bias", "min_tokens", "penalties", "grammar_bitmask",
                     "temperature", "top_k_top_p",
                     "min_p"]
    sampler = Sampler()
    assert sampler.active_stages(make_meta([SamplingParams(temperature=0)] * 2)) == []
    allowed = torch.ones(1, VOCAB, dtype=torch.bool)
    active = sampler.active_stages(make_meta([SamplingParams(temperature=0)] * 2, [1], allowed))
    assert [type(s) for s in active] == [GrammarBitmaskStage]
    active = sampler.active_stages(make_meta([SamplingParams(temperature=0.7)]))
    assert [type(s) for s in active] == [TemperatureStage]


PATHS = {
    "pure_greedy": [SamplingParams(temperature=0)] * 4,
    "mixed_greedy_random": [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2,
    "temperature_only": [SamplingParams(temperature=1.5)] * 4,  # fused C++ draw
    "top_k": [SamplingParams(temperature=1.0, top_k=5)] * 4,
    "top_p": [SamplingParams(temperature=1.0, top_p=0.5)] * 4,
    "min_p": [SamplingParams(temperature=1.0, min_p=0.2)] * 4,
    "penalties_bias": [SamplingParams(temperature=1.0, presence_penalty=1.0, logit_bias={3: 100.0})] * 4,
}


@pytest.mark.parametrize("mode", DRAW_MODES)
@pytest.mark.parametrize("path", list(PATHS))
def test_masked_rows_never_sample_outside_the_mask(path: str, mode: str, monkeypatch) -> None:
    use_draw(mode, monkeypatch)
    params = PATHS[path]
    allowed = torch.zeros(4, VOCAB, dtype=torch.bool)
    allowed[0, [7, 250]] = True
    allowed[1, 299] = True
    allowed[2, ::3] = True
    allowed[3, :] = True  # an unconstrained row in the same batch
    logits = adversarial(4, allowed)
    grammar_rows = [0, 1, 2]
    sampler = Sampler()
    for seed in range(20):
        torch.manual_seed(seed)
        meta = make_meta(params, grammar_rows, allowed[:3])
        before = logits.clone()
        ids = sampler(logits, meta).sampled_token_ids
        assert torch.equal(logits, before), "the caller's logits must not change"
        for row in range(3):
            assert allowed[row, ids[row]], (path, row, ids[row].item())
        assert 0 <= ids[3] < VOCAB


@pytest.mark.parametrize("mode", DRAW_MODES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fully_masked_row_gives_token_zero_not_nan(temperature: float, mode: str, monkeypatch) -> None:
    use_draw(mode, monkeypatch)
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[1, 42] = True
    logits = torch.randn(2, VOCAB)
    meta = make_meta([SamplingParams(temperature=temperature)] * 2, [0, 1], allowed)
    processed = Sampler().process_logits(logits, meta)
    assert not bool(processed.isnan().any())
    ids = Sampler()(logits, meta).sampled_token_ids
    assert ids.tolist() == [0, 42]


def test_process_logits_then_draw_equals_forward_for_greedy_rows() -> None:
    allowed = torch.rand(6, VOCAB) < 0.2
    allowed[:, 0] = True
    logits = adversarial(6, allowed)
    params = [SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0.9, top_k=3)] * 3
    meta = make_meta(params, list(range(6)), allowed)
    sampler = Sampler()
    processed = sampler.process_logits(logits, meta)
    assert processed.shape == logits.shape and processed.dtype == torch.float32
    forward_ids = sampler(logits, meta).sampled_token_ids
    drawn = sampler.draw(processed, meta)
    greedy_rows = [0, 2, 4]
    assert torch.equal(processed[greedy_rows].argmax(dim=1), forward_ids[greedy_rows])
    assert torch.equal(drawn[greedy_rows], forward_ids[greedy_rows])
    # Random rows: processed logits are -inf outside the grammar and outside the row's top-3.
    for row in (1, 3, 5):
        finite = processed[row].isfinite()
        assert bool(allowed[row][finite].all()) and int(finite.sum()) <= 3
        assert allowed[row, drawn[row]]


def test_several_rows_of_one_request_share_a_generator() -> None:
    # Speculative decoding: k+1 rows of one seeded request; the metadata is row-wise, nothing breaks.
    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=1.0, seed=3)] * 3
    meta = make_meta(params, generators=[gen, gen, gen])
    ids = Sampler()(torch.randn(3, VOCAB), meta).sampled_token_ids
    assert ids.shape == (3,)


def test_cpp_kernel_masked_low_temperature_and_all_masked(monkeypatch) -> None:
    from pagedllm.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    assert kernels is not None
    logits = torch.full((4, 1000), float("-inf"))
    logits[1, 5] = 0.0
    logits[2, [900, 901]] = torch.tensor([-1e20, -1e20 + 1e14])  # huge but finite logits stay drawable
    logits[3, 500:] = torch.randn(500) * 50
    for u in (torch.zeros(4), torch.full((4,), 1 - 2**-24), torch.rand(4)):
        got = kernels.sample_from_logits(logits, torch.tensor([1.0, 0.01, 1.0, 0.05]), u)
        assert got[0] == 0 and got[1] == 5 and got[2] in (900, 901) and got[3] >= 500


def test_xgrammar_and_torch_bitmask_apply_agree(monkeypatch) -> None:

    allowed = torch.rand(3, VOCAB) < 0.1
    logits = torch.randn(5, VOCAB)
    meta = make_meta([SamplingParams(temperature=0)] * 5, [0, 2, 4], allowed)
    assert platform_for("cpu").grammar_bitmask_apply(torch.float32) is not None
    with_xgrammar = Sampler().process_logits(logits, meta)
    monkeypatch.setattr(platform_for("cpu"), "grammar_bitmask_apply", lambda dtype: None)
    with_torch = Sampler().process_logits(logits, meta)
    assert torch.equal(with_xgrammar, with_torch)
    assert torch.equal(with_torch[[0, 2, 4]].isfinite(), allowed)
    assert torch.equal(with_torch[[1, 3]], logits[[1, 3]])


def test_fused_grammar_draw_is_used_only_when_it_is_the_tail() -> None:
    from pagedllm.sample.draw import masked_draw_kernel

    logits = torch.randn(2, VOCAB)
    assert masked_draw_kernel(logits) is not None
    assert masked_draw_kernel(logits.t().contiguous().t()) is None  # rows not contiguous
    assert masked_draw_kernel(logits.to(torch.bfloat16)) is None
    assert masked_draw_kernel(logits.to(torch.bfloat16), copied=True) is not None


@pytest.mark.parametrize("vocab", [VOCAB, 320, 49152 + 17])
def test_fused_greedy_equals_fill_then_argmax(vocab: int) -> None:
    torch.manual_seed(vocab)
    rows = 8
    allowed = torch.rand(rows, vocab) < torch.tensor([0.001, 0.01, 0.3, 0.9, 1.0, 0.5, 0.05, 0.2]).unsqueeze(1)
    allowed[:, -1] |= torch.arange(rows) % 2 == 0  # the tail word
    allowed[5] = False  # fully masked: token 0
    logits = torch.randn(rows, vocab)
    logits[6, ::7] = 3.0  # ties: the first allowed one wins, like torch.argmax
    grammar_rows = [0, 1, 2, 3, 5, 6]  # rows 4 and 7 unconstrained
    meta = build_sampling_metadata([SamplingParams(temperature=0)] * rows, [[]] * rows, [[]] * rows,
                                   [None] * rows, [0], vocab, CPU, grammar_rows=grammar_rows,
                                   grammar_bitmask=pack_bitmask(allowed[grammar_rows]))
    fused = Sampler()(logits, meta).sampled_token_ids
    filled = logits.clone()
    filled[grammar_rows] = filled[grammar_rows].masked_fill(~allowed[grammar_rows], float("-inf"))
    assert fused.tolist() == filled.argmax(dim=1).tolist()
    assert fused[5] == 0


def test_fused_random_draw_matches_the_fill_then_draw_path(monkeypatch) -> None:
    """Same uniforms, same distribution: the fused draw picks the token the -inf fill + C++ draw picks (up
    to float rounding at a CDF boundary), and an unconstrained row bit for bit."""
    rows, vocab = 6, 49152
    torch.manual_seed(1)
    allowed = torch.rand(rows, vocab) < torch.tensor([0.002, 0.05, 0.5, 0.98, 1.0, 0.0]).unsqueeze(1)
    allowed[5, [11, 30000]] = True
    grammar_rows = [0, 1, 2, 3, 5]
    params = [SamplingParams(temperature=t) for t in (0.7, 1.0, 1.3, 0.5, 0.9, 2.0)]
    same = total = 0
    for trial in range(40):
        logits = torch.randn(rows, vocab) * 3
        meta_args = dict(grammar_rows=grammar_rows, allowed=allowed[grammar_rows])
        torch.manual_seed(trial)
        fused = Sampler()(logits, make_vocab_meta(params, vocab, **meta_args)).sampled_token_ids
        with monkeypatch.context() as m:
            m.setattr(sampler_module, "masked_draw_kernel", lambda *a, **k: None)
            torch.manual_seed(trial)
            filled = Sampler()(logits, make_vocab_meta(params, vocab, **meta_args)).sampled_token_ids
        for row in grammar_rows:
            assert allowed[row, fused[row]]
        assert fused[4] == filled[4], "an unconstrained row draws bit for bit as without a grammar"
        same += int((fused == filled).sum())
        total += rows
    assert same >= total - 2, (same, total)


def test_fused_draw_follows_the_masked_softmax() -> None:
    from pagedllm.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    vocab = 100
    logits = torch.randn(1, vocab)
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [3, 31, 32, 64, 99]] = True
    n = 20000
    u = torch.rand(n)
    got = torch.stack([kernels.sample_masked(logits, torch.tensor([0.8]), u[i:i + 1], torch.tensor([False]),
                                             pack_bitmask(allowed), torch.tensor([0])) for i in range(n)]).flatten()
    want = torch.softmax(logits[0].masked_fill(~allowed[0], float("-inf")) / 0.8, dim=0)
    freq = torch.bincount(got, minlength=vocab).float() / n
    assert set(got.unique().tolist()) <= {3, 31, 32, 64, 99}
    assert torch.allclose(freq, want, atol=0.015)


def make_vocab_meta(params, vocab, grammar_rows, allowed):
    rows = len(params)
    return build_sampling_metadata(params, [[] for _ in range(rows)], [[] for _ in range(rows)], [None] * rows,
                                   [0], vocab, CPU, grammar_rows=grammar_rows, grammar_bitmask=pack_bitmask(allowed))


def test_fused_mixed_batch_rows_equal_their_solo_draws() -> None:
    """Seeded random rows (free and constrained) and greedy rows draw in a mixed batch exactly as alone."""
    vocab = 49152
    torch.manual_seed(4)
    logits = torch.randn(4, vocab) * 2
    allowed = torch.rand(4, vocab) < 0.01
    params = [SamplingParams(temperature=0.9, seed=11), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=0), SamplingParams(temperature=0)]
    grammar = {1: allowed[1], 3: allowed[3]}  # rows 1 and 3 constrained

    def run(rows: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(params[r].seed) if params[r].seed is not None else None for r in rows]
        g_rows = [i for i, r in enumerate(rows) if r in grammar]
        meta = build_sampling_metadata([params[r] for r in rows], [[]] * len(rows), [[]] * len(rows), gens, [0],
                                       vocab, CPU, grammar_rows=g_rows or None,
                                       grammar_bitmask=pack_bitmask(torch.stack([grammar[rows[i]] for i in g_rows]))
                                       if g_rows else None)
        return Sampler()(logits[rows], meta).sampled_token_ids.tolist()

    batched = run([0, 1, 2, 3])
    assert batched == [run([r])[0] for r in range(4)]
    assert allowed[1, batched[1]] and allowed[3, batched[3]]
