"""Verify draft tokens against the target model so the output distribution is exactly the target's.

For each request with drafts d_1..d_k the target gave k + 1 rows of logits (after its sampling stages):
p_1..p_{k+1}. Greedy requests accept d_i while it equals argmax p_i and then take argmax of the first
row that disagreed (or of p_{k+1}). Random requests use the standard rule (Leviathan et al. 2023; Chen et
al. 2023): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from the
normalized max(0, p_i - q_i) and stop; if all are accepted draw a bonus token from p_{k+1}. q_i is the
distribution the drafter sampled d_i from; a deterministic drafter (n-gram lookup) has q_i = one-hot(d_i).
Each request draws its uniforms from its own generator when it has a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler


def process_target_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [N, V] -> a processed float32 copy [N, V]: every sampling stage except the draw, exactly the
    stages ``Sampler`` applies (``Sampler.process_logits``), one row per verified position. Greedy rows come
    out so that their argmax is the Sampler's greedy choice."""
    return _SAMPLER.process_logits(logits, meta)


_SAMPLER = Sampler()


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


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand(1, generator=generator, device=device)) if generator is not None \
        else float(torch.rand(1, device=device))


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalized probs [V] with one uniform u in [0, 1)."""
    cdf = probs.double().cumsum(0)
    # 1 - u lies in (0, 1], so a zero-probability token (a flat step of the CDF) is never chosen.
    target = (1.0 - u) * cdf[-1]
    return int(torch.searchsorted(cdf, target.unsqueeze(0)).clamp_(max=probs.shape[0] - 1))


def rejection_sample(processed_logits: torch.Tensor, runs: list[DraftRun]) -> list[list[int]]:
    """processed_logits [N, V] (see process_target_logits) -> per run its new tokens (1 to k + 1)."""
    device = processed_logits.device
    argmax = processed_logits.argmax(dim=1).tolist() if any(r.greedy for r in runs) else None
    out: list[list[int]] = []
    for run in runs:
        k = len(run.draft_token_ids)
        if run.greedy:
            tokens = []
            for i in range(k + 1):
                tokens.append(argmax[run.first_row + i])
                if i == k or tokens[-1] != run.draft_token_ids[i]:
                    break
            out.append(tokens)
            continue
        probs = processed_logits[run.first_row:run.first_row + k + 1].softmax(dim=1)
        tokens = []
        for i, draft in enumerate(run.draft_token_ids):
            p = probs[i]
            q_draft = 1.0 if run.draft_probs is None else float(run.draft_probs[i, draft])
            u = _uniform(run.generator, device)
            if u * q_draft < float(p[draft]):  # accepted with probability min(1, p/q)
                tokens.append(draft)
                continue
            if run.draft_probs is None:
                residual = p.clone()
                residual[draft] = 0.0
            else:
                residual = (p - run.draft_probs[i]).clamp_(min=0.0)
            if not float(residual.sum()) > 0.0:  # only by rounding (p == q can never reject)
                residual = p
            tokens.append(_draw(residual, _uniform(run.generator, device)))
            break
        else:
            tokens.append(_draw(probs[k], _uniform(run.generator, device)))
        out.append(tokens)
    return out
