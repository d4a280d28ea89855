"""The largest step the engine can issue, run once on a throw-away KV cache so the worker can measure its
memory peak before sizing the GPU KV cache (``--gpu-memory-utilization``, ``worker.py``).

The peak has two parts: the forward pass's activations, which grow with the step's tokens (not with how
they split into requests), and the sampler's [rows, vocab] temporaries (a full-vocabulary sort for top-p,
penalty counts, log-softmax for logprobs), which grow with the rows that sample. The step here fills both:
the whole token budget, split into prompts no longer than ``max_model_len``, then the sampler's most
expensive stages on ``max_num_seqs`` rows.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.attention.forward_context import forward_context
from pagedllm.attention.metadata import build_attention_metadata, token_positions
from pagedllm.sample.batch_state import build_sampling_metadata
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams


def profile_query_lens(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the largest step: the token budget in prompts of at most ``max_model_len`` tokens,
    at most ``max_num_seqs`` prompts, one-token prompts first (the metadata wants decodes first)."""
    budget = max(1, max_num_batched_tokens)
    longest = max(1, min(budget, max_model_len)) if max_model_len > 0 else budget
    lens: list[int] = []
    while budget > 0 and len(lens) < max(1, max_num_seqs):
        lens.append(min(longest, budget))
        budget -= lens[-1]
    return sorted(lens, key=lambda q: q != 1)


def worst_case_sampling_params() -> SamplingParams:
    """A request that turns on every sampler stage with [rows, vocab] temporaries (top-p without top-k sorts
    the whole vocabulary; penalties count tokens per row; logprobs keep a log-softmax)."""
    return SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, presence_penalty=0.1, frequency_penalty=0.1,
                          repetition_penalty=1.1, logprobs=MAX_LOGPROBS)


@torch.inference_mode()
def run_profile_step(runner: Any, query_lens: list[int], block_size: int, max_sampling_rows: int) -> None:
    """Run ``query_lens`` fresh prompts through ``runner`` (a ModelRunner) on a KV cache allocated for them,
    then sample ``min(tokens, max_sampling_rows)`` rows with ``worst_case_sampling_params``; the KV cache is
    released afterwards (also on failure)."""
    device = runner.device
    blocks_per_req = [-(-q // block_size) for q in query_lens]
    runner.init_kv_cache(sum(blocks_per_req) + 1)  # block 0 is the null block
    try:
        tables, first = [], 1
        for n in blocks_per_req:
            tables.append(list(range(first, first + n)))
            first += n
        meta = build_attention_metadata(query_lens, query_lens, tables, block_size, device)
        num_tokens = sum(query_lens)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.from_numpy(token_positions(query_lens, query_lens)).to(device)
        runner.prepare_attention(meta)
        with forward_context(meta):
            hidden = runner.model(input_ids, positions)
        if runner.pooling is not None:
            return  # a pooling model samples nothing
        rows = min(num_tokens, max(1, max_sampling_rows))
        logits = runner.model.compute_logits(hidden[:rows])
        del hidden
        params = worst_case_sampling_params()
        sampling_meta = build_sampling_metadata(
            [params] * rows, [[0]] * rows, [[0]] * rows, [None] * rows, runner.eos_token_ids, runner.vocab_size,
            device)
        runner.sampler(logits, sampling_meta)
    finally:
        runner.release_kv_cache()
