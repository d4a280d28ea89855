"""The C++ inverse-CDF sampler against the same rule computed in float64 with torch."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    assert k is not None, "the C++ CPU kernels must build on the test machine"
    return k


def _cdf_and_target(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor):
    """float64 CDF [B, V] of softmax(logits / T) and the mass (1 - u) of the total each row must reach."""
    probs = torch.softmax(logits.double() / temperature.double().unsqueeze(1), dim=1)
    cdf = probs.cumsum(dim=1)
    return cdf, (1.0 - u.double().unsqueeze(1)) * cdf[:, -1:]


@pytest.mark.parametrize("vocab", [1, 7, 64, 1000, 49152])  # below, at and across the 64-token chunks
def test_sample_from_logits_matches_inverse_cdf(kernels, vocab: int) -> None:
    torch.manual_seed(vocab)
    rows = 40
    logits = torch.randn(rows, vocab) * 3
    temperature = torch.rand(rows) * 1.5 + 0.1
    u = torch.rand(rows)
    got = kernels.sample_from_logits(logits, temperature, u)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    # The chosen token's step of the CDF holds the target, up to float32 summation error over the vocab.
    cdf, target = _cdf_and_target(logits, temperature, u)
    tol = 1e-5 + 2e-7 * vocab ** 0.5
    upper = cdf.gather(1, got.unsqueeze(1))
    lower = torch.where(got.unsqueeze(1) > 0, cdf.gather(1, (got - 1).clamp(min=0).unsqueeze(1)), 0.0)
    assert bool((upper >= target - tol).all()) and bool((lower <= target + tol).all())
    exact = torch.searchsorted(cdf, target).squeeze(1).clamp(max=vocab - 1)
    assert (got == exact).float().mean() >= 0.9  # off only where the target sits at a step's edge


def test_masked_tokens_are_never_drawn(kernels) -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 300)
    logits[:, ::2] = float("-inf")  # only odd ids may come out
    logits[0, :] = float("-inf")
    logits[0, 123] = 0.0  # one drawable token
    for u in (torch.zeros(64), torch.full((64,), 1 - 2**-24), torch.rand(64)):
        got = kernels.sample_from_logits(logits, torch.ones(64), u)
        assert got[0].item() == 123
        assert bool((got[1:] % 2 == 1).all())


def test_draws_reach_the_last_partial_chunk(kernels) -> None:
    # 1,000 tokens: 15 chunks of 64 and a tail of 40. Only two tokens of the tail are drawable: the draw skips the
    # empty chunks by their sums, and u = 0 (the target is the whole sum) still lands on the last drawable token.
    logits = torch.full((3, 1000), float("-inf"))
    logits[:, 990] = 0.0
    logits[:, 999] = 0.0
    got = kernels.sample_from_logits(logits, torch.ones(3), torch.tensor([0.0, 0.75, 1 - 2**-24]))
    assert got.tolist() == [999, 990, 990]


def test_strided_rows_and_frequencies(kernels) -> None:
    # Rows of a wider tensor; with many draws the frequencies follow softmax(logits / T).
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 9.0]])[:, :4].expand(20000, 4)
    wide = torch.zeros(20000, 10)
    wide[:, :4] = logits
    got = kernels.sample_from_logits(wide[:, :4], torch.full((20000,), 2.0), torch.rand(20000))
    freq = torch.bincount(got, minlength=4).double() / 20000
    expected = torch.softmax(logits[0].double() / 2.0, dim=0)
    assert torch.allclose(freq, expected, atol=0.015)


def test_sample_from_logits_rejects_bad_input(kernels) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        kernels.sample_from_logits(torch.randn(2, 5, dtype=torch.float64), torch.ones(2), torch.rand(2))
    with pytest.raises(RuntimeError, match="one value per row"):
        kernels.sample_from_logits(torch.randn(2, 5), torch.ones(3), torch.rand(2))


@pytest.mark.parametrize("vocab", [1, 5, 31, 32, 33, 1000, 49152])  # inside, at and across 32-token words
def test_argmax_rows_equals_torch_argmax_ties_and_masked_rows_included(kernels, vocab: int) -> None:
    torch.manual_seed(vocab + 1)
    logits = torch.randn(9, vocab)
    logits[1] = 0.5  # every token tied: the first index
    if vocab > 3:
        top = logits[2].max() + 1
        logits[2, vocab - 1] = top
        logits[2, 3] = top  # a tie across words: the first index
    logits[3] = float("-inf")  # every token masked: 0, as argmax
    logits[4, -1] = 1e9  # the last token (the tail of the last word)
    got = kernels.argmax_rows(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=1))
    strided = torch.randn(4, vocab + 7)[:, :vocab]  # rows a stride apart
    assert torch.equal(kernels.argmax_rows(strided), strided.argmax(dim=1))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.randn(vocab + 1, 9).t())  # columns a row apart
