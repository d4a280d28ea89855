"""Logits -> next token ids (+ logprobs) for one batch, in one vectorized pass.

Order: logit_bias, min_tokens mask, penalties, then argmax for greedy rows; random rows get temperature,
top-k, top-p, min-p and inverse-CDF sampling (on CPUs, rows with only a temperature are sampled by one
C++ pass, ``kernels/csrc/sampling.cpp``, that writes no [B, V] temporaries). Returned logprobs are the
model's raw log-softmax, taken before any of those steps (vLLM's default). Nothing here reads a value
back to the host, so it runs without device syncs on any backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.cpu import kernels_for
from pagedllm.sample.metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Logprobs for B positions. Column 0 is the chosen (sampled or target) token; 1..k are the top-k.

    token_ids: [B, k+1] int64, logprobs: [B, k+1] float32, ranks: [B] int64 (1-based rank of column 0).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """sampled_token_ids: [B] int64; logprobs present when any row asked for them."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """logprobs [N, V] (already log-softmaxed), token_ids [N] -> LogprobsTensors with k = num_logprobs."""
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    # Rank = 1 + number of tokens strictly more likely; ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=1) + 1
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), chosen
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def compute_logprobs_for_targets(logits: torch.Tensor, target_ids: torch.Tensor,
                                 num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs: logits [N, V] at N positions, target_ids [N] the actual next tokens.

    Returns column 0 = the target token's logprob, columns 1..num_logprobs = the top tokens.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _gather_logprobs(logprobs, target_ids, num_logprobs)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """In place on logits [B, V]: repetition (prompt + output), then frequency/presence (output only)."""
    num_rows, vocab = logits.shape
    output_ids = meta.output_token_ids
    assert output_ids is not None and meta.repetition_penalties is not None
    # Pad id == vocab_size lands in an extra column that is dropped, so padding costs no masking.
    output_counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]
    output_seen = output_counts > 0

    if meta.prompt_token_ids is not None:
        prompt_seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        prompt_seen.scatter_(1, meta.prompt_token_ids, True)
        seen = prompt_seen[:, :vocab] | output_seen
        penalty = meta.repetition_penalties.unsqueeze(1)
        # HF/vLLM rule: shrink the logit toward "less likely" whatever its sign.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))

    assert meta.frequency_penalties is not None and meta.presence_penalties is not None
    logits.sub_(meta.frequency_penalties.unsqueeze(1) * output_counts)
    logits.sub_(meta.presence_penalties.unsqueeze(1) * output_seen.to(logits.dtype))


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


def draw_uniforms(meta: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row, [B, 1] float32; seeded rows draw from their own generator."""
    u = torch.rand(num_rows, 1, device=device) if meta.has_unseeded_random \
        else torch.empty(num_rows, 1, device=device)
    for row, generator in meta.generators.items():
        u[row] = torch.rand(1, generator=generator, device=device)
    return u


def inverse_cdf_sample(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sample one token per row of probs [B, V] with one uniform draw per row (inverse CDF).

    One random number per row instead of V (an exponential race) keeps sampling cheap on CPUs, where
    drawing B x V noise values cost more than the rest of the sampler. Seeded rows draw from their own
    generator, so their tokens do not depend on what else is in the batch.
    """
    cdf = probs.cumsum_(dim=1)  # probs is the sampler's private copy
    u = draw_uniforms(meta, probs.shape[0], probs.device).to(probs.dtype)
    # 1 - U lies in (0, 1]: a zero-probability token (flat step of the CDF) can never be the first >= u.
    target = (1.0 - u) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).clamp_(max=probs.shape[1] - 1).squeeze(1)


class Sampler(nn.Module):
    """Turns a step's logits into token ids. Does not modify the caller's logits."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32 -> SamplerOutput (sampled ids [B], optional logprobs [B, k+1])."""
        if (meta.all_greedy and meta.no_logit_bias and meta.no_min_tokens and meta.no_penalties
                and meta.max_num_logprobs is None):
            # Pure greedy: nothing rewrites the logits, so skip the private copy.
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=1), logprobs=None)

        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        # Stages that rewrite the logits work in place on one private copy; without them the caller's
        # logits are only read.
        private = not (meta.no_logit_bias and meta.no_min_tokens and meta.no_penalties)
        if private:
            logits = logits.to(torch.float32, copy=True)
        if not meta.no_logit_bias:
            logits.index_put_((meta.logit_bias_rows, meta.logit_bias_tokens), meta.logit_bias_values,
                              accumulate=True)
        if not meta.no_min_tokens:
            logits[meta.min_tokens_rows, meta.min_tokens_tokens] = float("-inf")
        if not meta.no_penalties:
            apply_penalties(logits, meta)

        greedy_ids = None
        if not meta.all_random:
            greedy_ids = logits.argmax(dim=1)
        if meta.all_greedy:
            sampled = greedy_ids
        else:
            sampled = self._sample_random(logits, meta, private)
            if greedy_ids is not None:
                sampled = torch.where(meta.greedy_mask, greedy_ids, sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, meta: SamplingMetadata, private: bool) -> torch.Tensor:
        """logits [B, V] -> [B] sampled ids; greedy rows' results are discarded by the caller.

        ``private``: logits is the sampler's own copy and may be changed in place.
        """
        assert meta.temperature is not None
        kernels = kernels_for(logits)
        if kernels is not None and meta.no_top_p_top_k and meta.no_min_p:
            # Temperature + inverse CDF in one C++ pass that writes no [B, V] temporaries.
            u = draw_uniforms(meta, logits.shape[0], logits.device)
            return kernels.sample_from_logits(logits, meta.temperature, u.squeeze(1))
        if not private:
            logits = logits.to(torch.float32, copy=True)
        logits.div_(meta.temperature.unsqueeze(1))
        if not meta.no_top_p_top_k:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k,
                                       meta.top_p_without_top_k)
        if not meta.no_min_p:
            logits = apply_min_p(logits, meta.min_p)
        probs = logits.softmax(dim=1)
        return inverse_cdf_sample(probs, meta)
