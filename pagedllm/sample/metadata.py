"""Per-step batch tensors for the sampler, built from the requests' SamplingParams.

Built every step for up to a few hundred rows, so the builder is one Python pass over the rows and only
materializes the tensors some row actually needs; each sampler stage (``sample/stages.py``) reads the flag
or tensor that says whether some row needs it. Everything is per row, never per request: a request may own
several rows (speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.host_to_device import tensor_on, to_device
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """Sampling inputs for one step; row i is request i of the batch (B rows, vocab V).

    Tensors that no row needs are ``None``; the matching ``no_*`` / ``all_*`` flag is then True.
    """

    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] float32; 1.0 on greedy rows so dividing by it is harmless. None when all rows are greedy.
    temperature: torch.Tensor | None
    # [B] bool, True for greedy rows. None unless the batch mixes greedy and random rows.
    greedy_mask: torch.Tensor | None
    # [B] float32, 1.0 = off. None when no random row uses top-p.
    top_p: torch.Tensor | None
    # [B] int64, vocab_size = off. None when no random row uses top-k.
    top_k: torch.Tensor | None
    # Largest active top-k in the batch (host int, so the sampler can call topk without a device sync).
    max_top_k: int
    # Some random row uses top-p without top-k (forces a full-vocabulary sort).
    top_p_without_top_k: bool
    # [B] float32, 0.0 = off. None when no random row uses min-p.
    min_p: torch.Tensor | None
    # Row index -> that request's own generator, for random rows only.
    generators: dict[int, torch.Generator]
    # True when some random row has no generator and so needs the shared batched noise draw.
    has_unseeded_random: bool
    # [B] float32 each. None when no row uses any penalty.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [B, Lp] int64 padded with vocab_size; only rows with a repetition penalty are filled. None if unused.
    prompt_token_ids: torch.Tensor | None
    # [B, Lo] int64 padded with vocab_size; only rows with some penalty are filled. None if unused.
    output_token_ids: torch.Tensor | None
    # Sparse logit bias as parallel [M] tensors: logits[rows[j], tokens[j]] += values[j].
    logit_bias_rows: torch.Tensor | None
    logit_bias_tokens: torch.Tensor | None
    logit_bias_values: torch.Tensor | None
    # Sparse min_tokens mask as parallel [M] tensors: logits[rows[j], tokens[j]] = -inf.
    min_tokens_rows: torch.Tensor | None
    min_tokens_tokens: torch.Tensor | None
    # Max logprobs requested by any row (0 = only the sampled token), or None when no row wants logprobs.
    max_num_logprobs: int | None
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


def _pad_rows(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """list of B token lists -> [B, max_len] int64 padded with ``pad`` (numpy: far cheaper than lists)."""
    width = max((len(r) for r in rows), default=0)
    arr = np.full((len(rows), max(width, 1)), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        if row:
            arr[i, : len(row)] = row
    return to_device(torch.from_numpy(arr), device)


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
    """Build the batch tensors for one sampling step.

    ``params``, ``output_token_ids``, ``prompt_token_ids`` and ``generators`` are per row (length B).
    ``eos_token_ids`` are the model's EOS ids (shared by every row); they are masked alongside each row's
    ``stop_token_ids`` while that row has fewer than ``min_tokens`` outputs, unless it sets ``ignore_eos``.
    Token ids >= ``vocab_size`` in logit_bias / stop_token_ids are dropped here (the front end should
    reject them with ``SamplingParams.verify_token_ids``).
    ``grammar_rows`` / ``grammar_bitmask`` [len(grammar_rows), ceil(V/32)] int32: the rows under a grammar and
    the tokens each may take next (xgrammar's bitmask layout). ``decoding_rules``: the model's own rules
    (``WhisperDecodingRules``), applied to every row without ``allowed_token_ids``.
    """
    num_rows = len(params)
    words = (vocab_size + 31) // 32
    if grammar_rows and (grammar_bitmask is None or tuple(grammar_bitmask.shape) != (len(grammar_rows), words)):
        raise ValueError("build_sampling_metadata: grammar_bitmask must be [len(grammar_rows), ceil(V/32)]")
    if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == num_rows):
        raise ValueError("build_sampling_metadata: params, output_token_ids, prompt_token_ids and "
                         "generators must all have one entry per row")

    temperature: list[float] = []
    greedy: list[bool] = []
    top_p: list[float] = []
    top_k: list[int] = []
    min_p: list[float] = []
    row_generators: dict[int, torch.Generator] = {}
    has_unseeded_random = False
    use_top_p = use_top_k = use_min_p = False
    top_p_without_top_k = False
    max_top_k = 0
    presence: list[float] = []
    frequency: list[float] = []
    repetition: list[float] = []
    use_penalties = use_repetition = False
    penalty_outputs: list[list[int]] = []
    penalty_prompts: list[list[int]] = []
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    mask_rows: list[int] = []
    mask_tokens: list[int] = []
    num_logprobs: list[int | None] = []
    max_num_logprobs: int | None = None

    for i, p in enumerate(params):
        is_greedy = p.temperature < SAMPLING_EPS
        greedy.append(is_greedy)
        if is_greedy:
            # Truncation is irrelevant for argmax; neutral values keep these rows out of every filter.
            temperature.append(1.0)
            top_p.append(1.0)
            top_k.append(vocab_size)
            min_p.append(0.0)
        else:
            temperature.append(p.temperature)
            top_p.append(p.top_p)
            use_top_p |= p.top_p < 1.0
            k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            top_k.append(k)
            if k < vocab_size:
                use_top_k = True
                max_top_k = max(max_top_k, k)
            elif p.top_p < 1.0:
                top_p_without_top_k = True
            min_p.append(p.min_p)
            use_min_p |= p.min_p > 0.0
            gen = generators[i]
            if gen is not None:
                row_generators[i] = gen
            else:
                has_unseeded_random = True

        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        repetition.append(p.repetition_penalty)
        row_penalized = (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                         or p.repetition_penalty != 1.0)
        # Rows without penalties contribute empty lists so long unrelated sequences do not widen the pad.
        penalty_outputs.append(output_token_ids[i] if row_penalized else [])
        penalty_prompts.append(prompt_token_ids[i] if p.repetition_penalty != 1.0 else [])
        use_penalties |= row_penalized
        use_repetition |= p.repetition_penalty != 1.0

        if p.logit_bias:
            for token_id, value in p.logit_bias.items():
                if token_id < vocab_size:
                    bias_rows.append(i)
                    bias_tokens.append(token_id)
                    bias_values.append(value)

        if len(output_token_ids[i]) < p.min_tokens:
            stop_ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stop_ids.update(eos_token_ids)
            for token_id in stop_ids:
                if 0 <= token_id < vocab_size:
                    mask_rows.append(i)
                    mask_tokens.append(token_id)

        num_logprobs.append(p.logprobs)
        if p.logprobs is not None:
            max_num_logprobs = p.logprobs if max_num_logprobs is None else max(max_num_logprobs, p.logprobs)

    all_greedy = all(greedy)
    all_random = not any(greedy)
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    allowed_mask = None
    if allowed:
        mask = np.zeros((len(allowed), vocab_size), dtype=np.bool_)
        for j, i in enumerate(allowed):
            ids = [t for t in params[i].allowed_token_ids if t < vocab_size]
            mask[j, ids] = True
        allowed_mask = to_device(torch.from_numpy(mask), device)
    whisper = None
    if decoding_rules is not None:
        ruled = [i for i, p in enumerate(params) if p.allowed_token_ids is None]
        whisper = decoding_rules.step(ruled, prompt_token_ids, output_token_ids, device)

    # On CUDA every tensor below is queued without a stream sync (host_to_device.py): the model runner builds
    # this metadata while the GPU still runs the step's forward pass.
    def f32(values: list[float]) -> torch.Tensor:
        return tensor_on(values, torch.float32, device)

    def i64(values: list[int]) -> torch.Tensor:
        return tensor_on(values, torch.int64, device)

    prompt_tensor = output_tensor = None
    if use_penalties:
        output_tensor = _pad_rows(penalty_outputs, vocab_size, device)
        if use_repetition:
            prompt_tensor = _pad_rows(penalty_prompts, vocab_size, device)

    return SamplingMetadata(
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=all_random,
        temperature=None if all_greedy else f32(temperature),
        greedy_mask=None if (all_greedy or all_random) else tensor_on(greedy, torch.bool, device),
        top_p=f32(top_p) if use_top_p else None,
        top_k=i64(top_k) if use_top_k else None,
        max_top_k=max_top_k,
        top_p_without_top_k=top_p_without_top_k,
        min_p=f32(min_p) if use_min_p else None,
        generators=row_generators,
        has_unseeded_random=has_unseeded_random,
        presence_penalties=f32(presence) if use_penalties else None,
        frequency_penalties=f32(frequency) if use_penalties else None,
        repetition_penalties=f32(repetition) if use_penalties else None,
        prompt_token_ids=prompt_tensor,
        output_token_ids=output_tensor,
        logit_bias_rows=i64(bias_rows) if bias_rows else None,
        logit_bias_tokens=i64(bias_tokens) if bias_rows else None,
        logit_bias_values=f32(bias_values) if bias_rows else None,
        min_tokens_rows=i64(mask_rows) if mask_rows else None,
        min_tokens_tokens=i64(mask_tokens) if mask_rows else None,
        max_num_logprobs=max_num_logprobs,
        no_penalties=not use_penalties,
        no_top_p_top_k=not (use_top_p or use_top_k),
        no_min_p=not use_min_p,
        no_logit_bias=not bias_rows,
        no_min_tokens=not mask_rows,
        num_logprobs=num_logprobs,
        grammar_rows=i64(grammar_rows) if grammar_rows else None,
        grammar_bitmask=to_device(grammar_bitmask, device) if grammar_rows else None,
        allowed_rows=tensor_on(allowed, torch.int64, device) if allowed else None,
        allowed_mask=allowed_mask,
        whisper=whisper,
    )
