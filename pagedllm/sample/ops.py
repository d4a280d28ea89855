"""The sampler's tensor operations on logits [B, V], in place: penalties, top-k/top-p, min-p, and the grammar
bitmask's unpacking. No state, no stages: the stages (``sample/stages/``) gather their inputs and call these."""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, output_ids: torch.Tensor, prompt_ids: torch.Tensor | None,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """In place on logits [B, V]: repetition (prompt + output), then frequency/presence (output only).

    output_ids [B, Lo] and prompt_ids [B, Lp] int64 padded with V (prompt_ids None: no row has a repetition
    penalty); presence, frequency, repetition [B] float32 (0, 0, 1 = off).
    """
    num_rows, vocab = logits.shape
    # Pad id == vocab_size lands in an extra column that is dropped, so padding costs no masking.
    output_counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]
    output_seen = output_counts > 0

    if prompt_ids is not None:
        prompt_seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        prompt_seen.scatter_(1, prompt_ids, True)
        seen = prompt_seen[:, :vocab] | output_seen
        penalty = repetition.unsqueeze(1)
        # HF/vLLM rule: shrink the logit toward "less likely" whatever its sign.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))

    logits.sub_(frequency.unsqueeze(1) * output_counts)
    logits.sub_(presence.unsqueeze(1) * output_seen.to(logits.dtype))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [M, ceil(V/32)] int32 (bit j of word w allows token 32*w + j) -> allowed [M, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(2) >> shifts) & 1  # [M, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int, top_p_without_top_k: bool) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k, then its nucleus (top-p), to -inf, in place.

    top_k: [B] int64 (V = off) or None; top_p: [B] float32 (1.0 = off) or None; not both None.
    ``max_top_k`` is the largest active top-k; ``top_p_without_top_k`` says some row uses top-p with no
    top-k. Top-p keeps the smallest prefix (descending probability, renormalized after top-k) whose mass
    reaches top_p; the most likely token always survives.
    """
    num_rows, vocab = logits.shape
    # When every top-p row is also top-k limited, only the best max_top_k tokens can survive, and a
    # topk of those is far cheaper than sorting the whole vocabulary.
    if top_k is not None and not (top_p is not None and top_p_without_top_k):
        width = min(max(max_top_k, 1), vocab)
    else:
        width = vocab
    if width < vocab:
        sorted_logits, sorted_idx = logits.topk(width, dim=1)  # descending
    else:
        sorted_logits, sorted_idx = logits.sort(dim=1, descending=True)

    positions = torch.arange(width, device=logits.device).unsqueeze(0)  # [1, width]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= positions >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
        # Mass strictly before each token: a token is kept while that mass is still below top_p.
        mass_before = probs.cumsum(dim=1) - probs
        drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False

    keep = torch.zeros(num_rows, vocab, dtype=torch.bool, device=logits.device)
    keep.scatter_(1, sorted_idx, ~drop)
    if width < vocab:
        # Rows with top-k off were not truncated at all (they have no top-p either, by the width rule).
        keep |= (top_k >= vocab).unsqueeze(1)
    return logits.masked_fill_(~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] whose probability is below min_p [B] times the row's top probability."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps off rows untouched.
    threshold = logits.amax(dim=1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))
