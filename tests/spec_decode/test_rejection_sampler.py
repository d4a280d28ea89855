"""The rejection rule against exactly computed distributions."""

import pytest
import torch

from pagedllm.sample.rejection_sampler import DraftRun, rejection_sample

from helpers.stats_helpers import goodness_of_fit

V = 6
N = 20000


def _dist(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * 1.5).softmax(0)


@pytest.mark.parametrize("one_hot", [False, True])
def test_output_tokens_follow_the_target_distribution(one_hot: bool) -> None:
    p1, p2, p3 = _dist(1), _dist(2), _dist(3)
    q1, q2 = _dist(4), _dist(5)
    gen = torch.Generator().manual_seed(0)
    if one_hot:  # a deterministic drafter always proposes the same tokens
        d1 = torch.full((N,), 2)
        d2 = torch.full((N,), 4)
    else:
        d1 = torch.multinomial(q1, N, replacement=True, generator=gen)
        d2 = torch.multinomial(q2, N, replacement=True, generator=gen)
    logits = torch.stack([p1.log(), p2.log(), p3.log()]).repeat(N, 1)
    q = None if one_hot else torch.stack([q1, q2])
    runs = [DraftRun(3 * i, [int(d1[i]), int(d2[i])], greedy=False, draft_probs=q, generator=gen) for i in range(N)]
    out = rejection_sample(logits, runs)

    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=V).tolist()
    stat, crit = goodness_of_fit(first, p1.tolist())
    assert stat < crit, (stat, crit)
    # Given the first draft was accepted, the second token is distributed as p2.
    second = torch.bincount(torch.tensor([t[1] for t in out if len(t) >= 2]), minlength=V).tolist()
    stat, crit = goodness_of_fit(second, p2.tolist())
    assert stat < crit, (stat, crit)
    third = torch.bincount(torch.tensor([t[2] for t in out if len(t) == 3]), minlength=V).tolist()
    stat, crit = goodness_of_fit(third, p3.tolist())
    assert stat < crit, (stat, crit)
    # Acceptance of the first draft happens with probability sum_x min(p(x), q(x)).
    accepted = sum(1 for t in out if len(t) >= 2) / N
    expected = float(p1[2]) if one_hot else float(torch.minimum(p1, q1).sum())
    assert abs(accepted - expected) < 4 * (expected * (1 - expected) / N) ** 0.5 + 1e-3


def test_greedy_accepts_while_drafts_match_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 0.0, 0.0]])
    out = rejection_sample(logits, [DraftRun(0, [1, 0, 1], greedy=True)])
    assert out == [[1, 0, 2]]  # third draft (1) rejected, argmax 2 replaces it
    out = rejection_sample(logits, [DraftRun(0, [1, 0, 2], greedy=True)])
    assert out == [[1, 0, 2, 0]]  # all accepted + bonus
    out = rejection_sample(logits, [DraftRun(0, [2], greedy=True)])
    assert out == [[1]]


def test_a_seeded_run_repeats() -> None:
    logits = torch.randn(4, 50)
    runs = lambda: [DraftRun(0, [3, 7, 9], greedy=False, generator=torch.Generator().manual_seed(5))]  # noqa: E731
    assert rejection_sample(logits, runs()) == rejection_sample(logits, runs())


def test_a_draft_the_target_rules_out_is_never_accepted() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]]).repeat(500, 1)
    runs = [DraftRun(2 * i, [1], greedy=False) for i in range(500)]
    assert all(t[0] != 1 for t in rejection_sample(logits, runs))
