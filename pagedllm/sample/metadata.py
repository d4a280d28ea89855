"""One step's sampler inputs: per-row tensors gathered from the stages' per-request state.

The stages and the draw keep each request's values from the moment it joins the runner's batch
(``sample/batch_state.py``); ``SamplingBatch.metadata`` gathers a step's rows into this one object, each stage
filling its own fields, and only materializes the tensors some row actually needs. Everything is per row,
never per request: a request may own several rows (speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Sampling inputs for one step; row i is request i of the batch (B rows, vocab V).

    Tensors that no row needs are ``None``; the matching ``no_*`` / ``all_*`` flag is then True.
    """

    vocab_size: int
    all_greedy: bool = True
    all_random: bool = True
    # [B] float32; 1.0 on greedy rows so dividing by it is harmless. None when all rows are greedy.
    temperature: torch.Tensor | None = None
    # [B] bool, True for greedy rows. None unless the batch mixes greedy and random rows.
    greedy_mask: torch.Tensor | None = None
    # [B] float32, 1.0 = off. None when no random row uses top-p.
    top_p: torch.Tensor | None = None
    # [B] int64, vocab_size = off. None when no random row uses top-k.
    top_k: torch.Tensor | None = None
    # Largest active top-k in the batch (host int, so the sampler can call topk without a device sync).
    max_top_k: int = 0
    # Some random row uses top-p without top-k (forces a full-vocabulary sort).
    top_p_without_top_k: bool = False
    # [B] float32, 0.0 = off. None when no random row uses min-p.
    min_p: torch.Tensor | None = None
    # Row index -> that request's own generator, for random rows only.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # True when some random row has no generator and so needs the shared batched noise draw.
    has_unseeded_random: bool = False
    # [B] float32 each. None when no row uses any penalty.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [B, Lp] int64 padded with vocab_size; only rows with a repetition penalty are filled. None if unused.
    prompt_token_ids: torch.Tensor | None = None
    # [B, Lo] int64 padded with vocab_size; only rows with some penalty are filled. None if unused.
    output_token_ids: torch.Tensor | None = None
    # Sparse logit bias as parallel [M] tensors: logits[rows[j], tokens[j]] += values[j].
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_tokens: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # Sparse min_tokens mask as parallel [M] tensors: logits[rows[j], tokens[j]] = -inf.
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_tokens: torch.Tensor | None = None
    # Max logprobs requested by any row (0 = only the sampled token), or None when no row wants logprobs.
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    no_top_p_top_k: bool = True
    no_min_p: bool = True
    no_logit_bias: bool = True
    no_min_tokens: bool = True
    # Structured outputs: rows under a grammar [M] int64 and their allowed-token bitmask [M, ceil(V/32)]
    # int32 (bit j of word w allows token 32*w + j). None when no row has a grammar.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Per-row requested logprobs count (None = not requested), so the engine can slice [B, k+1] results.
    num_logprobs: list[int | None] = field(default_factory=list)
    # allowed_token_ids: rows that set it [M] int64 and their allowed tokens [M, V] bool. None when no row does.
    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None
    # A Whisper model's decoding rules for this step (sample/whisper_rules.py), or None.
    whisper: Any = None


def build_sampling_metadata(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device,
    grammar_rows: list[int] | None = None,
    grammar_bitmask: torch.Tensor | None = None,
    decoding_rules: Any = None,
) -> SamplingMetadata:
    """The metadata of a one-off batch, each row its own request (tests, the profiling step): a fresh
    ``SamplingBatch`` holding the rows, asked for one step. The runner keeps its batch across steps instead.

    ``params``, ``output_token_ids``, ``prompt_token_ids`` and ``generators`` are per row (length B).
    ``eos_token_ids`` are the model's EOS ids (shared by every row); they are masked alongside each row's
    ``stop_token_ids`` while that row has fewer than ``min_tokens`` outputs, unless it sets ``ignore_eos``.
    Token ids >= ``vocab_size`` in logit_bias / stop_token_ids are dropped (the front end should
    reject them with ``SamplingParams.verify_token_ids``). ``grammar_rows`` / ``grammar_bitmask``
    [len(grammar_rows), ceil(V/32)] int32: the rows under a grammar and the tokens each may take next
    (xgrammar's bitmask layout). ``decoding_rules``: the model's own rules (``WhisperDecodingRules``), applied
    to every row without ``allowed_token_ids``.
    """
    from pagedllm.sample.batch_state import SamplingBatch

    num_rows = len(params)
    if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == num_rows):
        raise ValueError("build_sampling_metadata: params, output_token_ids, prompt_token_ids and "
                         "generators must all have one entry per row")
    batch = SamplingBatch(vocab_size, eos_token_ids, device)
    ids = [str(row) for row in range(num_rows)]
    batch.update(added=list(zip(ids, params, prompt_token_ids, output_token_ids, generators)))
    try:
        return batch.metadata(ids, grammar_rows=grammar_rows, grammar_bitmask=grammar_bitmask,
                              decoding_rules=decoding_rules)
    except ValueError as e:
        raise ValueError(f"build_sampling_metadata: {e}") from None
