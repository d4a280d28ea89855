"""The sampler's logits stages, in the order they run: each says itself whether the batch needs it.

A stage works in place on the sampler's private float32 copy of the logits [N, V] (N rows, vocab V).
Rows are independent: a stage reads only per-row metadata, so several rows may belong to one request
(speculative decoding scores k+1 positions of a request in one call). Greedy rows carry neutral values
(temperature 1, no truncation), so after every stage their argmax is still the right token.

Masked logits are set to -inf; the draw (``sample/draw.py``) never picks a -inf logit while the row has a
finite one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.platforms import platform_of
from pagedllm.sample.metadata import SamplingMetadata


class LogitsStage(Protocol):
    """One step of logits processing. ``apply`` may change ``logits`` in place and returns it."""

    name: str

    def is_active(self, meta: SamplingMetadata) -> bool: ...

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor: ...


# ---- the operations -------------------------------------------------------------------------------------

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


# ---- the stages -----------------------------------------------------------------------------------------

class AllowedTokensStage:
    """Rows with ``allowed_token_ids``: every other token gets -inf."""

    name = "allowed_token_ids"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return meta.allowed_rows is not None

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.allowed_rows is not None and meta.allowed_mask is not None
        rows = logits.index_select(0, meta.allowed_rows).masked_fill_(~meta.allowed_mask, float("-inf"))
        return logits.index_copy_(0, meta.allowed_rows, rows)


class LogitBiasStage:
    name = "logit_bias"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_logit_bias

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return logits.index_put_((meta.logit_bias_rows, meta.logit_bias_tokens), meta.logit_bias_values,
                                 accumulate=True)


class MinTokensStage:
    """Stop tokens (EOS + stop_token_ids) are masked until a row has min_tokens outputs."""

    name = "min_tokens"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_min_tokens

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits[meta.min_tokens_rows, meta.min_tokens_tokens] = float("-inf")
        return logits


class PenaltiesStage:
    name = "penalties"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_penalties

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        apply_penalties(logits, meta)
        return logits


class GrammarBitmaskStage:
    """Tokens a row's grammar does not allow next get -inf (structured outputs)."""

    name = "grammar_bitmask"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return meta.grammar_bitmask is not None

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.grammar_bitmask is not None and meta.grammar_rows is not None
        rows, bitmask = meta.grammar_rows, meta.grammar_bitmask
        apply_cpu = platform_of(logits).grammar_bitmask_apply(logits.dtype)
        if apply_cpu is not None:
            full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
            full[rows] = bitmask
            apply_cpu(logits, full, vocab_size=logits.shape[1], indices=rows.tolist(), backend="cpu")
            return logits
        allowed = unpack_bitmask(bitmask, logits.shape[1])
        logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
        return logits


class TemperatureStage:
    name = "temperature"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.all_greedy

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None
        return logits.div_(meta.temperature.unsqueeze(1))


class TopKTopPStage:
    name = "top_k_top_p"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_top_p_top_k

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k, meta.top_p_without_top_k)


class MinPStage:
    name = "min_p"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_min_p

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.min_p is not None
        return apply_min_p(logits, meta.min_p)


def default_stages() -> list[LogitsStage]:
    """The processing order: the model's own rules (Whisper's), the tokens a request allows, what the request asked
    for (bias, min_tokens, penalties, grammar), then the distribution's shape (temperature, truncation). The
    grammar comes before truncation so top-k/top-p pick among allowed tokens only."""
    from pagedllm.sample.whisper_rules import WhisperRulesStage

    return [WhisperRulesStage(), AllowedTokensStage(), LogitBiasStage(), MinTokensStage(), PenaltiesStage(),
            GrammarBitmaskStage(), TemperatureStage(), TopKTopPStage(), MinPStage()]
