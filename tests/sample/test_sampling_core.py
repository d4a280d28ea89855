"""The pieces the sampler and speculation share: the one inverse-CDF draw, per-row uniforms, the logprob dicts."""

from __future__ import annotations

import torch

from pagedllm.sample.draw import inverse_cdf, row_uniforms
from pagedllm.sample.sampler import LogprobsTensors, compute_logprobs_for_targets, logprob_dicts


def _reference_draw(row: torch.Tensor, u: float, dtype: torch.dtype) -> int:
    """One row drawn by hand: the first token whose cumulative probability reaches (1 - u) x total."""
    cdf = row.to(dtype).cumsum(0)
    target = (1.0 - torch.tensor(u, dtype=dtype)) * cdf[-1]
    return int((cdf < target).sum().clamp(max=row.shape[0] - 1))


def test_inverse_cdf_matches_a_row_by_row_draw_in_both_precisions() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(50, 37, generator=g) ** 4  # unnormalized, far from uniform
    probs[::7, 5:] = 0.0  # rows with a zero tail
    for dtype in (torch.float32, torch.float64):
        u = torch.rand(50, generator=g, dtype=dtype)
        before = probs.clone()
        got = inverse_cdf(probs, u)
        assert torch.equal(probs, before)  # not in place unless asked
        assert got.dtype == torch.int64 and got.shape == (50,)
        assert got.tolist() == [_reference_draw(probs[i], float(u[i]), dtype) for i in range(50)]
        assert torch.equal(inverse_cdf(probs, u.unsqueeze(1)), got)  # [N] or [N, 1] uniforms


def test_inverse_cdf_never_picks_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]]).repeat(4, 1)
    u = torch.tensor([0.0, 0.3333, 0.999999, 0.5])  # u = 0 reaches the total itself: the last non-zero token
    assert inverse_cdf(probs, u).tolist() == [3, 3, 1, 3]
    nan_row = torch.full((1, 5), float("nan"))
    assert inverse_cdf(nan_row, torch.tensor([0.4])).tolist() == [0]  # every logit was -inf: token 0


def test_inverse_cdf_in_place_reuses_the_probabilities() -> None:
    probs = torch.rand(3, 8)
    expected = inverse_cdf(probs, torch.full((3,), 0.25))
    assert torch.equal(inverse_cdf(probs, torch.full((3,), 0.25), in_place=True), expected)
    assert torch.all(probs[:, 1:] >= probs[:, :-1])  # it now holds the CDF


def test_row_uniforms_take_seeded_rows_from_their_generators() -> None:
    gens = {1: torch.Generator().manual_seed(7), 3: torch.Generator().manual_seed(8)}
    u = row_uniforms(4, gens, torch.device("cpu"), per_row=3, dtype=torch.float64)
    assert u.shape == (4, 3) and u.dtype == torch.float64
    assert torch.equal(u[1], torch.rand(3, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    assert torch.equal(u[3], torch.rand(3, generator=torch.Generator().manual_seed(8), dtype=torch.float64))
    # Every row seeded: the default generator is left alone.
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    row_uniforms(1, {0: torch.Generator().manual_seed(1)}, torch.device("cpu"), unseeded=False)
    assert torch.equal(torch.rand(2), expected)


def test_logprob_dicts_put_the_chosen_token_first_without_repeating_it() -> None:
    lp = LogprobsTensors(token_ids=torch.tensor([[4, 4, 9], [7, 2, 9]]),
                         logprobs=torch.tensor([[-0.5, -0.5, -1.0], [-3.0, -0.125, -0.25]]),
                         ranks=torch.tensor([1, 5]))
    entries = logprob_dicts(lp, [2, 1])
    assert entries == [{4: (-0.5, 1), 9: (-1.0, 2)}, {7: (-3.0, 5), 2: (-0.125, 1)}]
    assert list(entries[1]) == [7, 2]  # the chosen token first, then the top ones


def test_logprob_dicts_of_targets_match_the_log_softmax() -> None:
    logits = torch.randn(3, 20)
    targets = torch.tensor([3, 0, 19])
    entries = logprob_dicts(compute_logprobs_for_targets(logits, targets, 2), [2, 2, 0])
    raw = torch.log_softmax(logits, dim=-1)
    for row, entry in enumerate(entries):
        token = int(targets[row])
        assert entry[token][0] == float(raw[row, token])
        assert entry[token][1] == int((raw[row] > raw[row, token]).sum()) + 1
        assert len(entry) == (1 if row == 2 else len({token, *raw[row].topk(2).indices.tolist()}))
