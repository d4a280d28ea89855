"""The sampler's logits stages, in the order they run: each keeps its own per-request state and says itself
whether the batch needs it.

A stage's state lives in per-slot columns (``sample/batch_state.py``): ``update_state`` writes a request's
values once when it joins the batch and resets them when it leaves; ``prepare`` gathers the step's rows into
the stage's fields of that step's SamplingMetadata; ``apply`` works in place on the sampler's private
float32 copy of the logits [N, V] (N rows, vocab V). Rows are independent: a stage reads only per-row
metadata, so several rows may belong to one request (speculative decoding scores k+1 positions of a request
in one call). Greedy rows carry neutral values (temperature 1, no truncation), so after every stage their
argmax is still the right token. ``draw_fusion`` names what the draw can do in its own pass instead of the
stage when the stage comes last (``Sampler.forward``).

Masked logits are set to -inf; the draw (``sample/draw.py``) never picks a -inf logit while the row has a
finite one.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from pagedllm.host_to_device import tensor_on, to_device
from pagedllm.platforms import platform_of
from pagedllm.sample.batch_state import AddedRow, BatchUpdate, SlotRowState, StepRows
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SAMPLING_EPS


class LogitsStage(Protocol):
    """One step of logits processing. ``apply`` may change ``logits`` in place and returns it."""

    name: str
    draw_fusion: str | None  # "temperature" / "bitmask": the draw can stand in for this stage when it is last

    def update_state(self, update: BatchUpdate) -> None: ...

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None: ...

    def is_active(self, meta: SamplingMetadata) -> bool: ...

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor: ...


def _pad_rows(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """list of B token lists -> [B, max_len] int64 padded with ``pad`` (numpy: far cheaper than lists)."""
    width = max((len(r) for r in rows), default=0)
    arr = np.full((len(rows), max(width, 1)), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        if row:
            arr[i, : len(row)] = row
    return to_device(torch.from_numpy(arr), device)


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


# ---- the per-slot state ----------------------------------------------------------------------------------

def on_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A gathered numpy column as a tensor on ``device`` (queued without a stream sync on CUDA)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(values)), device)


class StatelessStage:
    """A stage whose step inputs come with the step (the grammar's bitmask) or from other stages' fields."""

    draw_fusion: str | None = None

    def update_state(self, update: BatchUpdate) -> None:
        pass

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        pass


class DrawRows(SlotRowState):
    """What the draw needs per request: greedy or not, temperature, its own generator, logprobs wanted.

    Greedy slots hold temperature 1.0 so dividing by it is harmless; ``unseeded``: a random request without
    a generator (it takes the shared batched draw); ``logprobs`` -1 = not requested. ``using``: the random
    requests; ``logprob_slots``: those that want logprobs.
    """

    columns = {"greedy": (np.bool_, True), "temperature": (np.float32, 1.0), "unseeded": (np.bool_, False),
               "logprobs": (np.int64, -1)}

    def __init__(self) -> None:
        super().__init__()
        self.logprob_slots: set[int] = set()

    def forget(self, slot: int) -> None:
        super().forget(slot)
        self.logprob_slots.discard(slot)

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p, slot, cols = row.params, row.slot, self.rows
        if p.logprobs is not None:
            cols["logprobs"][slot] = p.logprobs
            self.logprob_slots.add(slot)
        if p.temperature < SAMPLING_EPS:
            return False
        cols["greedy"][slot] = False
        cols["temperature"][slot] = p.temperature
        if row.generator is not None:
            self.extras[slot] = row.generator
        else:
            cols["unseeded"][slot] = True
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        slots, cols, num_rows = step.slots, self.rows, len(step.slots)
        meta.all_random = num_rows == 0
        if self.using:
            greedy = cols["greedy"][slots]
            meta.all_greedy = bool(greedy.all())
            meta.all_random = not greedy.any()
            if not meta.all_greedy:
                meta.temperature = on_device(cols["temperature"][slots], step.device)
                if not meta.all_random:
                    meta.greedy_mask = on_device(greedy, step.device)
                meta.has_unseeded_random = bool(cols["unseeded"][slots].any())
            if self.extras:
                meta.generators = {row: self.extras[slot] for row, slot in enumerate(slots.tolist())
                                   if slot in self.extras}
        if not self.logprob_slots:
            meta.num_logprobs = [None] * num_rows
            return
        wanted = cols["logprobs"][slots]
        meta.num_logprobs = [None if k < 0 else k for k in wanted.tolist()]
        if (wanted >= 0).any():
            meta.max_num_logprobs = int(wanted.max())


# ---- the stages -----------------------------------------------------------------------------------------

class AllowedTokensStage(SlotRowState):
    """Rows with ``allowed_token_ids``: every other token gets -inf."""

    name = "allowed_token_ids"
    draw_fusion = None

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        if row.params.allowed_token_ids is None:
            return False
        self.extras[row.slot] = [t for t in row.params.allowed_token_ids if t < update.vocab_size]
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        rows = self.used_rows(step)
        if rows is None:
            return
        mask = np.zeros((rows.size, step.vocab_size), dtype=np.bool_)
        for j, slot in enumerate(step.slots[rows].tolist()):
            mask[j, self.extras[slot]] = True
        meta.allowed_rows = on_device(rows.astype(np.int64), step.device)
        meta.allowed_mask = on_device(mask, step.device)

    def is_active(self, meta: SamplingMetadata) -> bool:
        return meta.allowed_rows is not None

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.allowed_rows is not None and meta.allowed_mask is not None
        rows = logits.index_select(0, meta.allowed_rows).masked_fill_(~meta.allowed_mask, float("-inf"))
        return logits.index_copy_(0, meta.allowed_rows, rows)


class LogitBiasStage(SlotRowState):
    """Adds each request's ``logit_bias`` (ids past the vocabulary dropped) to its rows."""

    name = "logit_bias"
    draw_fusion = None

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        bias = [(t, v) for t, v in (row.params.logit_bias or {}).items() if t < update.vocab_size]
        if not bias:
            return False
        self.extras[row.slot] = ([t for t, _ in bias], [v for _, v in bias])
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        rows = self.used_rows(step)
        if rows is None:
            return
        bias_rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for row, slot in zip(rows.tolist(), step.slots[rows].tolist()):
            row_tokens, row_values = self.extras[slot]
            bias_rows.extend([row] * len(row_tokens))
            tokens.extend(row_tokens)
            values.extend(row_values)
        meta.logit_bias_rows = tensor_on(bias_rows, torch.int64, step.device)
        meta.logit_bias_tokens = tensor_on(tokens, torch.int64, step.device)
        meta.logit_bias_values = tensor_on(values, torch.float32, step.device)
        meta.no_logit_bias = False

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_logit_bias

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return logits.index_put_((meta.logit_bias_rows, meta.logit_bias_tokens), meta.logit_bias_values,
                                 accumulate=True)


class MinTokensStage(SlotRowState):
    """Stop tokens (EOS + stop_token_ids, EOS left out under ``ignore_eos``) are masked until a row has
    min_tokens outputs."""

    name = "min_tokens"
    draw_fusion = None
    columns = {"min_tokens": (np.int64, 0)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p = row.params
        if p.min_tokens <= 0:
            return False
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids.update(update.eos_token_ids)
        self.rows["min_tokens"][row.slot] = p.min_tokens
        self.extras[row.slot] = [t for t in stop_ids if 0 <= t < update.vocab_size]
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        rows = self.used_rows(step)
        if rows is None:
            return
        wanted = self.rows["min_tokens"][step.slots]
        mask_rows: list[int] = []
        mask_tokens: list[int] = []
        for row in rows.tolist():
            if len(step.outputs[row]) < wanted[row]:
                stop_ids = self.extras[int(step.slots[row])]
                mask_rows.extend([row] * len(stop_ids))
                mask_tokens.extend(stop_ids)
        if mask_rows:
            meta.min_tokens_rows = tensor_on(mask_rows, torch.int64, step.device)
            meta.min_tokens_tokens = tensor_on(mask_tokens, torch.int64, step.device)
            meta.no_min_tokens = False

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_min_tokens

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits[meta.min_tokens_rows, meta.min_tokens_tokens] = float("-inf")
        return logits


class PenaltiesStage(SlotRowState):
    """Presence, frequency (output tokens) and repetition (prompt + output tokens) penalties."""

    name = "penalties"
    draw_fusion = None
    columns = {"presence": (np.float32, 0.0), "frequency": (np.float32, 0.0), "repetition": (np.float32, 1.0),
               "repeats": (np.bool_, False)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p, slot, cols = row.params, row.slot, self.rows
        penalized = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        if not penalized:
            return False
        cols["presence"][slot] = p.presence_penalty
        cols["frequency"][slot] = p.frequency_penalty
        cols["repetition"][slot] = p.repetition_penalty
        cols["repeats"][slot] = p.repetition_penalty != 1.0
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        if self.used_rows(step) is None:
            return
        slots, cols = step.slots, self.rows
        penalized, repeats = cols["in_use"][slots], cols["repeats"][slots]
        # Rows without penalties contribute empty lists so long unrelated sequences do not widen the pad.
        meta.output_token_ids = _pad_rows([out if on else [] for out, on in zip(step.outputs, penalized.tolist())],
                                          step.vocab_size, step.device)
        if repeats.any():
            meta.prompt_token_ids = _pad_rows([p if on else [] for p, on in zip(step.prompts, repeats.tolist())],
                                              step.vocab_size, step.device)
        meta.presence_penalties = on_device(cols["presence"][slots], step.device)
        meta.frequency_penalties = on_device(cols["frequency"][slots], step.device)
        meta.repetition_penalties = on_device(cols["repetition"][slots], step.device)
        meta.no_penalties = False

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_penalties

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        apply_penalties(logits, meta)
        return logits


class GrammarBitmaskStage(StatelessStage):
    """Tokens a row's grammar does not allow next get -inf (structured outputs); the step brings the
    bitmask. The CPU draw can read the bitmask itself (``draw_fusion``), with no [N, V] fill."""

    name = "grammar_bitmask"
    draw_fusion = "bitmask"

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        if step.grammar_rows:
            meta.grammar_rows = tensor_on(step.grammar_rows, torch.int64, step.device)
            meta.grammar_bitmask = to_device(step.grammar_bitmask, step.device)

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


class TemperatureStage(StatelessStage):
    """Divides random rows' logits by their temperature (``DrawRows`` keeps it: the draw needs it too).
    The draw can divide in its own pass when this stage comes last (``draw_fusion``)."""

    name = "temperature"
    draw_fusion = "temperature"

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.all_greedy

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None
        return logits.div_(meta.temperature.unsqueeze(1))


class TopKTopPStage(SlotRowState):
    """Keeps each random row's top-k tokens, then its nucleus (top-p). ``top_k`` 0 = off (also greedy)."""

    name = "top_k_top_p"
    draw_fusion = None
    columns = {"top_k": (np.int64, 0), "top_p": (np.float32, 1.0)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p = row.params
        top_k = p.top_k if 0 < p.top_k < update.vocab_size else 0
        if p.temperature < SAMPLING_EPS or (top_k == 0 and p.top_p >= 1.0):
            return False  # truncation is irrelevant for argmax: greedy rows keep the neutral values
        self.rows["top_p"][row.slot] = p.top_p
        self.rows["top_k"][row.slot] = top_k
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        if not self.using:
            return
        top_k = self.rows["top_k"][step.slots]
        top_p = self.rows["top_p"][step.slots]
        limited, nucleus = top_k > 0, top_p < 1.0
        use_top_k, use_top_p = bool(limited.any()), bool(nucleus.any())
        if use_top_k:
            meta.top_k = on_device(np.where(limited, top_k, step.vocab_size), step.device)
            meta.max_top_k = int(top_k.max())
        if use_top_p:
            meta.top_p = on_device(top_p, step.device)
            meta.top_p_without_top_k = bool((nucleus & ~limited).any())
        meta.no_top_p_top_k = not (use_top_k or use_top_p)

    def is_active(self, meta: SamplingMetadata) -> bool:
        return not meta.no_top_p_top_k

    def apply(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k, meta.top_p_without_top_k)


class MinPStage(SlotRowState):
    """Masks tokens less likely than min_p times the row's most likely one (random rows; 0.0 = off)."""

    name = "min_p"
    draw_fusion = None
    columns = {"min_p": (np.float32, 0.0)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        if row.params.temperature < SAMPLING_EPS or row.params.min_p <= 0.0:
            return False
        self.rows["min_p"][row.slot] = row.params.min_p
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        if not self.using:
            return
        min_p = self.rows["min_p"][step.slots]
        if (min_p > 0.0).any():
            meta.min_p = on_device(min_p, step.device)
            meta.no_min_p = False

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
