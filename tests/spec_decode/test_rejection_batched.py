"""The batched rejection sampler decides exactly what the token-by-token rule decides (same tokens, same
seeded random streams, generators left in the same state) and reads the host once per step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedllm.sample.rejection_sampler import DraftRun, rejection_sample, rejection_sample_batch

from helpers.host_reads import HostReads


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=generator))


def _draw(probs: torch.Tensor, u: float) -> int:
    cdf = probs.double().cumsum(0)
    return int(torch.searchsorted(cdf, ((1.0 - u) * cdf[-1]).unsqueeze(0)).clamp_(max=probs.shape[0] - 1))


def token_by_token(processed: torch.Tensor, runs: list[DraftRun]) -> list[list[int]]:
    """The rule written one request and one draft at a time, a uniform drawn when it is needed (the sampler
    before it was batched): the reference."""
    out = []
    for run in runs:
        k = len(run.draft_token_ids)
        rows = processed[run.first_row:run.first_row + k + 1]
        if run.greedy:
            tokens = []
            for i in range(k + 1):
                tokens.append(int(rows[i].argmax()))
                if i == k or tokens[-1] != run.draft_token_ids[i]:
                    break
            out.append(tokens)
            continue
        probs = rows.softmax(dim=1)
        tokens = []
        for i, draft in enumerate(run.draft_token_ids):
            p = probs[i]
            q = 1.0 if run.draft_probs is None else float(run.draft_probs[i, draft])
            if _uniform(run.generator) * q < float(p[draft]):
                tokens.append(draft)
                continue
            if run.draft_probs is None:
                residual = p.clone()
                residual[draft] = 0.0
            else:
                residual = (p - run.draft_probs[i]).clamp(min=0.0)
            if not float(residual.sum()) > 0.0:
                residual = p
            tokens.append(_draw(residual, _uniform(run.generator)))
            break
        else:
            tokens.append(_draw(probs[k], _uniform(run.generator)))
        out.append(tokens)
    return out


def _batch(seed: int) -> tuple[torch.Tensor, Callable[[], list[DraftRun]]]:
    """Random requests of every kind (greedy, seeded one-hot, seeded with draft distributions, no drafts),
    draft lengths 0..4; returns logits and a maker of fresh runs (fresh generators at the same seeds)."""
    g = torch.Generator().manual_seed(seed)
    num, vocab = 2 + seed % 5, 5 + seed % 30
    ks = torch.randint(0, 5, (num,), generator=g).tolist()
    logits = torch.randn(sum(k + 1 for k in ks), vocab, generator=g) * (0.5 + seed % 4)
    if seed % 3 == 0:
        logits[:, 1] = float("-inf")  # a token the target rules out
    specs, first = [], 0
    for r, k in enumerate(ks):
        kind = (seed + r) % 3
        q = (torch.randn(k, vocab, generator=g) * 2).softmax(1) if kind == 2 else None
        if q is not None and k:  # drafts drawn from q: acceptances are common
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        elif kind == 0 and k:  # greedy: the target's argmax, then one wrong token now and then
            drafts = logits[first:first + k].argmax(1).tolist()
            drafts[-1] = (drafts[-1] + seed % 2) % vocab
        else:
            drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
        specs.append((first, drafts, kind == 0, q, 100 * seed + r))
        first += k + 1

    def runs() -> list[DraftRun]:
        return [DraftRun(f, list(d), greedy, q, torch.Generator().manual_seed(s)) for f, d, greedy, q, s in specs]

    return logits, runs


@pytest.mark.parametrize("seed", range(40))
def test_batched_equals_the_token_by_token_rule(seed: int) -> None:
    logits, runs = _batch(seed)
    expected_runs, got_runs = runs(), runs()
    assert rejection_sample(logits, got_runs) == token_by_token(logits, expected_runs)
    for expected, got in zip(expected_runs, got_runs):  # each generator continues where it did
        assert torch.equal(torch.rand(4, generator=got.generator), torch.rand(4, generator=expected.generator))


def test_one_transfer_to_the_host_per_step(monkeypatch) -> None:
    logits, runs = _batch(7)
    transfers = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: transfers.append(t.shape) or tolist(t))
    with torch.inference_mode(), HostReads() as watch:
        batch = rejection_sample_batch(logits, runs())
    # Index lifts of host lists (queued without a sync on CUDA) are allowed; no value is read back.
    assert [op for op in watch.seen if "lift_fresh" not in op] == [] and transfers == []
    assert batch.num_accepted.shape == batch.last_token.shape == (len(runs()),)
    with torch.inference_mode(), HostReads() as watch:
        rejection_sample(logits, runs())
    assert [op for op in watch.seen if "lift_fresh" not in op] == []
    assert transfers == [(2, len(runs()))]  # the step's one read: accepted counts and last tokens together


def test_unseeded_requests_draw_without_generators() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]).repeat(300, 1)
    runs = [DraftRun(2 * i, [i % 3], greedy=False) for i in range(300)]
    out = rejection_sample(logits, runs)
    assert all(len(t) in (1, 2) for t in out)
    accepted = sum(len(t) == 2 for t in out) / 300  # p(d) = 1/3 against a one-hot q
    assert 0.2 < accepted < 0.47
    assert all(t[0] != r.draft_token_ids[0] for t, r in zip(out, runs) if len(t) == 1)  # never the rejected draft
