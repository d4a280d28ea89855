"""Verify draft tokens against the target model so the output distribution is exactly the target's.

For each request with drafts d_1..d_k the target gave k + 1 rows of logits (after its sampling stages):
p_1..p_{k+1}. Greedy requests accept d_i while it equals argmax p_i and then take argmax of the first
row that disagreed (or of p_{k+1}). Random requests use the standard rule (Leviathan et al. 2023; Chen et
al. 2023): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from the
normalized max(0, p_i - q_i) and stop; if all are accepted draw a bonus token from p_{k+1}. q_i is the
distribution the drafter sampled d_i from; a deterministic drafter (n-gram lookup) has q_i = one-hot(d_i).
Each request draws its uniforms from its own generator when it has a seed.

The whole batch is decided at once: requests are padded to the longest draft run (R requests x K drafts),
every accept test is one tensor comparison, and each request's last token (the correction or the bonus) is
drawn from the one row it needs, picked on the device. The host reads the result once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.host_to_device import tensor_on
from pagedllm.sample.draw import greedy_tokens, inverse_cdf, row_uniforms


@dataclass
class DraftRun:
    """One request's verification job.

    ``first_row``: its first of ``len(draft_token_ids) + 1`` consecutive rows in the processed logits.
    ``draft_probs``: [k', V] float32 with k' >= k, row i the distribution d_i was drawn from; None for a
    deterministic drafter. ``generator``: the request's own (seeded) generator, or None.
    """

    first_row: int
    draft_token_ids: list[int]
    greedy: bool
    draft_probs: torch.Tensor | None = None
    generator: torch.Generator | None = None


@dataclass
class RejectionResult:
    """Device tensors of one verification, R requests: ``num_accepted`` [R] int64 (leading drafts kept) and
    ``last_token`` [R] int64 (the token after them: the target's correction, or the bonus token)."""

    num_accepted: torch.Tensor
    last_token: torch.Tensor


def _draft_distributions(runs: list[DraftRun], width: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """q [R, K, V] float32 (row i of a request: what d_i was drawn from; one-hot(d_i) for a deterministic
    drafter, zeros past its drafts), or None when no random request has drafted distributions."""
    if not any(r.draft_probs is not None and not r.greedy for r in runs):
        return None
    q = torch.zeros(len(runs), width, vocab, device=device)
    for i, run in enumerate(runs):
        k = len(run.draft_token_ids)
        if run.greedy or k == 0:
            continue
        if run.draft_probs is not None:
            q[i, :k] = run.draft_probs[:k]
        else:
            q[i, torch.arange(k, device=device), tensor_on(run.draft_token_ids, torch.long, device)] = 1.0
    return q


def rejection_sample_batch(processed_logits: torch.Tensor, runs: list[DraftRun]) -> RejectionResult:
    """processed_logits [N, V] (``Sampler.process_logits``) -> RejectionResult for ``runs`` (R of them), with
    no value read back to the host.

    Random requests consume their uniforms in the order of the token-by-token rule: u_i tests d_{i+1}, and
    the last token is drawn with the next one (u_{a+1} after a rejection at a, u_k after k acceptances).
    """
    device = processed_logits.device
    num_runs, vocab = len(runs), processed_logits.shape[1]
    lengths = [len(r.draft_token_ids) for r in runs]
    width = max(max(lengths, default=0), 1)  # K, at least one column so gathers at column 0 stay valid
    # Host-known layout, one copy each to the device: drafts [R, K] (0-padded), rows [R, K + 1] (request
    # r's row for position i, the last row repeated past its drafts).
    drafts = tensor_on([r.draft_token_ids + [0] * (width - len(r.draft_token_ids)) for r in runs],
                       torch.long, device)
    rows = tensor_on([[r.first_row + min(i, k) for i in range(width + 1)] for r, k in zip(runs, lengths)],
                     torch.long, device)
    num_drafts = tensor_on(lengths, torch.long, device)
    greedy = tensor_on([r.greedy for r in runs], torch.bool, device)
    valid = torch.arange(width, device=device).unsqueeze(0) < num_drafts.unsqueeze(1)  # [R, K]

    argmax = greedy_tokens(processed_logits) if any(r.greedy for r in runs) else None
    # Row-wise, so each request's rows come out as their own softmax would.
    probs = processed_logits.softmax(dim=1) if any(not r.greedy for r in runs) else None
    # [R, K]: greedy rows keep a draft equal to the target's argmax, random rows by the p/q test below.
    accepted = argmax[rows[:, :width]] == drafts if argmax is not None else valid
    u = q = None
    if probs is not None:
        random_rows = [i for i, r in enumerate(runs) if not r.greedy]
        seeded = {i: runs[i].generator for i in random_rows if runs[i].generator is not None}
        u = row_uniforms(num_runs, seeded, device, per_row=width + 1,
                         unseeded=len(seeded) < len(random_rows))  # [R, K + 1]
        q = _draft_distributions(runs, width, vocab, device)
        p_draft = probs[rows[:, :width], drafts]  # [R, K]: p_i(d_i)
        q_draft = torch.ones_like(p_draft) if q is None else \
            q.gather(2, drafts.unsqueeze(2)).squeeze(2)
        # Accepted with probability min(1, p/q); float64 as the scalar rule computed it.
        random_accepted = u[:, :width].double() * q_draft.double() < p_draft.double()
        accepted = random_accepted if argmax is None else torch.where(greedy.unsqueeze(1), accepted, random_accepted)
    accepted = accepted & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]: the leading run of acceptances

    last_row = rows.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [R]: row of the token after them
    last_token = argmax[last_row] if argmax is not None else None
    if probs is not None:
        assert u is not None
        p_last = probs[last_row]  # [R, V]
        rejected = (num_accepted < num_drafts).unsqueeze(1)
        at = num_accepted.clamp(max=width - 1).unsqueeze(1)  # the rejected draft's column
        if q is None:  # one-hot q: the residual is p without the rejected draft
            residual = p_last.scatter(1, drafts.gather(1, at), 0.0)
        else:
            q_last = q[torch.arange(num_runs, device=device), at.squeeze(1)]
            residual = (p_last - q_last).clamp_(min=0.0)
        # An empty residual only by rounding (p == q can never reject): draw from p then.
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0.0, residual, p_last)
        last_dist = torch.where(rejected, residual, p_last)
        u_last = u.gather(1, torch.minimum(num_accepted + 1, num_drafts).unsqueeze(1))
        sampled = inverse_cdf(last_dist, u_last.double(), in_place=True)
        last_token = sampled if last_token is None else torch.where(greedy, last_token, sampled)
    assert last_token is not None
    return RejectionResult(num_accepted=num_accepted, last_token=last_token)


def _rewind_generators(runs: list[DraftRun], states: dict[int, torch.Tensor], num_accepted: list[int],
                       device: torch.device) -> None:
    """Leave each seeded generator where the token-by-token rule would have: after a + 2 values when draft
    a + 1 was rejected, k + 1 when all k were accepted (the batch drew k + 1 up front), so the request's
    later draws, and so its seeded output, stay what they were."""
    for i, state in states.items():
        run = runs[i]
        used = min(num_accepted[i] + 2, len(run.draft_token_ids) + 1)
        run.generator.set_state(state)
        torch.rand(used, generator=run.generator, device=device, dtype=torch.float32)


def rejection_sample(processed_logits: torch.Tensor, runs: list[DraftRun]) -> list[list[int]]:
    """processed_logits [N, V] (``Sampler.process_logits``) -> per run its new tokens (1 to k + 1).

    One transfer to the host for the whole batch.
    """
    if not runs:
        return []
    device = processed_logits.device
    # A generator drawn from by one random run only can be put back exactly (a shared one stays past all).
    owners: dict[int, list[int]] = {}
    for i, run in enumerate(runs):
        if run.generator is not None and not run.greedy:
            owners.setdefault(id(run.generator), []).append(i)
    states = {rows[0]: runs[rows[0]].generator.get_state() for rows in owners.values() if len(rows) == 1}
    result = rejection_sample_batch(processed_logits, runs)
    num_accepted, last_token = torch.stack([result.num_accepted, result.last_token]).tolist()  # the one sync
    _rewind_generators(runs, states, num_accepted, device)
    return [run.draft_token_ids[:a] + [t] for run, a, t in zip(runs, num_accepted, last_token)]
