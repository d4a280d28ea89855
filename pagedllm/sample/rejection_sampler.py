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
from pagedllm.sample.sampler import apply_min_p, apply_penalties, apply_top_k_top_p


def process_target_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [N, V] -> a processed float32 copy [N, V]: every sampling stage except the draw.

    TEMPORARY (merge note for the lead): the same stages, in the same order, as ``Sampler.forward``
    (logit bias, min_tokens, penalties, then temperature, top-k/top-p, min-p on random rows). Replace the
    body with ``Sampler.process_logits(logits, meta)`` once the staged sampler lands; the rejection rule
    below only needs "processed logits in, one row per verified position".
    Greedy rows keep temperature 1 and no truncation (the metadata builder makes them neutral), so their
    argmax is the Sampler's greedy choice.
    """
    logits = logits.to(torch.float32, copy=True)
    if not meta.no_logit_bias:
        logits.index_put_((meta.logit_bias_rows, meta.logit_bias_tokens), meta.logit_bias_values, accumulate=True)
    if not meta.no_min_tokens:
        logits[meta.min_tokens_rows, meta.min_tokens_tokens] = float("-inf")
    if not meta.no_penalties:
        apply_penalties(logits, meta)
    if meta.all_greedy:
        return logits
    logits.div_(meta.temperature.unsqueeze(1))
    if not meta.no_top_p_top_k:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k, meta.top_p_without_top_k)
    if not meta.no_min_p:
        logits = apply_min_p(logits, meta.min_p)
    return logits


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
