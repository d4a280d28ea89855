"""Whisper's decoding rules as one sampler stage, which the worker puts first for a Whisper model
(``ModelRunner.add_model_rules_stage``); the default stage list knows nothing of them.

The rules and their order are transformers' (``WhisperForConditionalGeneration.generate``): at the first generated
position the begin-suppressed tokens (a space, ``<|endoftext|>``) are masked; the suppressed tokens always; then,
when the decoder prompt does not contain ``<|notimestamps|>``, the timestamp rules of
``WhisperTimeStampLogitsProcessor``:

- ``<|notimestamps|>`` is never sampled;
- timestamps come in pairs: after a timestamp that follows text, the next token is a timestamp or
  ``<|endoftext|>`` (no text); after two timestamps (or a first one), text;
- timestamps never decrease: tokens below the last timestamp are masked (below it + 1, unless the next token
  closes the pair it opened);
- the first generated token is a timestamp no later than ``max_initial_timestamp_index`` (50: 1 s);
- when the timestamps' total probability beats every text token, a timestamp is sampled (text masked).

"Generated" means the request's output tokens: the decoder prompt (``<|startofprev|>`` context included) is
transformers' ``begin_index``. A row that sets ``allowed_token_ids`` skips these rules (its caller named exactly
what may come next: language detection's one step over the language tokens from ``[<|startoftranscript|>]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.host_to_device import tensor_on
from pagedllm.sample.metadata import SamplingMetadata, StepState
from pagedllm.sample.stage_base import AddedRow, BatchUpdate, SlotRowState, StepRows


@dataclass(frozen=True)
class WhisperDecodingRules:
    """The model's ids: ``timestamp_begin`` = ``<|notimestamps|>`` + 1 (``<|0.00|>``); None: no timestamps."""

    vocab_size: int
    eos_token_id: int
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    no_timestamps_token_id: int | None
    max_initial_timestamp_index: int | None

    @property
    def timestamp_begin(self) -> int | None:
        return None if self.no_timestamps_token_id is None else self.no_timestamps_token_id + 1

    @classmethod
    def from_config(cls, hf_config: Any, vocab_size: int) -> WhisperDecodingRules:
        """From a resolved Whisper config (``loader/ct2_whisper.py`` / ``loader/whisper_config.py`` fill it)."""
        eos = hf_config.eos_token_id
        eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        no_ts = getattr(hf_config, "no_timestamps_token_id", None)
        max_initial = getattr(hf_config, "max_initial_timestamp_index", None)

        def ids(name: str) -> tuple[int, ...]:
            return tuple(int(t) for t in getattr(hf_config, name, None) or () if 0 <= int(t) < vocab_size)

        return cls(vocab_size, eos, ids("suppress_tokens"), ids("begin_suppress_tokens"),
                   None if no_ts is None else int(no_ts), None if max_initial is None else int(max_initial))

    def step(self, rows: list[int], prompts: list[list[int]], outputs: list[list[int]],
             device: torch.device) -> WhisperStepRules | None:
        """What the rules mask this step for the sampling ``rows`` (their prompts and outputs so far)."""
        if not rows:
            return None
        begin_rows = [r for r in rows if not outputs[r]]
        ts_begin = self.timestamp_begin
        ts = [] if ts_begin is None else [r for r in rows if self.no_timestamps_token_id not in prompts[r]]
        ts_min, must_text, must_timestamp, first = [], [], [], []
        for r in ts:
            seq = outputs[r]
            last_ts = len(seq) >= 1 and seq[-1] >= ts_begin
            penultimate_ts = len(seq) < 2 or seq[-2] >= ts_begin
            must_text.append(last_ts and penultimate_ts)
            must_timestamp.append(last_ts and not penultimate_ts)
            stamps = [t for t in seq if t >= ts_begin]
            if not stamps:
                ts_min.append(ts_begin)
            else:
                ts_min.append(stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1)
            first.append(not seq)
        return WhisperStepRules(
            rules=self,
            suppress_rows=tensor_on(rows, torch.int64, device) if self.suppress_tokens else None,
            suppress_ids=tensor_on(list(self.suppress_tokens), torch.int64, device),
            begin_rows=tensor_on(begin_rows, torch.int64, device) if begin_rows and self.begin_suppress_tokens
            else None,
            begin_ids=tensor_on(list(self.begin_suppress_tokens), torch.int64, device),
            timestamp_rows=tensor_on(ts, torch.int64, device) if ts else None,
            timestamp_min=tensor_on(ts_min, torch.int64, device) if ts else None,
            must_text=tensor_on(must_text, torch.bool, device) if ts else None,
            must_timestamp=tensor_on(must_timestamp, torch.bool, device) if ts else None,
            first=tensor_on(first, torch.bool, device) if ts else None,
        )


@dataclass(eq=False)
class WhisperStepRules(StepState):
    """The stage's step state, one step's masks: row index tensors [M] int64 and, for the timestamp rows,
    per-row flags [M]."""

    rules: WhisperDecodingRules
    suppress_rows: torch.Tensor | None
    suppress_ids: torch.Tensor
    begin_rows: torch.Tensor | None
    begin_ids: torch.Tensor
    timestamp_rows: torch.Tensor | None
    timestamp_min: torch.Tensor | None  # the lowest timestamp id the row may sample
    must_text: torch.Tensor | None
    must_timestamp: torch.Tensor | None  # a timestamp or eos
    first: torch.Tensor | None


def apply_whisper_rules(logits: torch.Tensor, step: WhisperStepRules) -> torch.Tensor:
    """In place on logits [B, V] (float32): begin-suppress, suppress, then the timestamp rules."""
    inf = float("-inf")
    if step.begin_rows is not None:
        logits[step.begin_rows.unsqueeze(1), step.begin_ids.unsqueeze(0)] = inf
    if step.suppress_rows is not None and step.suppress_ids.numel():
        logits[step.suppress_rows.unsqueeze(1), step.suppress_ids.unsqueeze(0)] = inf
    if step.timestamp_rows is None:
        return logits
    rules = step.rules
    ts_begin, eos = rules.timestamp_begin, rules.eos_token_id
    assert ts_begin is not None and step.timestamp_min is not None
    sub = logits.index_select(0, step.timestamp_rows)  # [M, V]
    sub[:, rules.no_timestamps_token_id] = inf
    vocab = torch.arange(sub.shape[1], device=sub.device).unsqueeze(0)
    is_timestamp = vocab >= ts_begin
    mask = is_timestamp & (vocab < step.timestamp_min.unsqueeze(1))
    mask |= step.must_text.unsqueeze(1) & is_timestamp
    mask |= step.must_timestamp.unsqueeze(1) & (vocab < eos)
    first_mask = ~is_timestamp
    if rules.max_initial_timestamp_index is not None:
        first_mask |= vocab > ts_begin + rules.max_initial_timestamp_index
    mask |= step.first.unsqueeze(1) & first_mask
    sub.masked_fill_(mask, inf)
    # A timestamp when their total probability beats every single text token's.
    logprobs = torch.log_softmax(sub, dim=-1)
    timestamp_logprob = logprobs[:, ts_begin:].logsumexp(dim=-1)
    max_text_logprob = logprobs[:, :ts_begin].max(dim=-1).values
    sub[:, :ts_begin].masked_fill_((timestamp_logprob > max_text_logprob).unsqueeze(1), inf)
    logits.index_copy_(0, step.timestamp_rows, sub)
    return logits


class WhisperRulesStage(SlotRowState):
    """The sampler stage of one model's ``rules`` (first of all: transformers runs these processors before any
    other). It keeps which requests the rules govern (those without ``allowed_token_ids``)."""

    name = "whisper_rules"
    draw_fusion = None

    def __init__(self, rules: WhisperDecodingRules) -> None:
        super().__init__()
        self.rules = rules

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        return row.params.allowed_token_ids is None

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> WhisperStepRules | None:
        ruled = self.used_rows(step)
        if ruled is None:  # no ruled row: the rules mask nothing
            return None
        return self.rules.step(ruled.tolist(), step.prompts, step.outputs, step.device)

    def apply(self, logits: torch.Tensor, state: WhisperStepRules) -> torch.Tensor:
        return apply_whisper_rules(logits, state)
