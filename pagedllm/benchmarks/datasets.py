"""Benchmark prompts: random token ids of an exact length, reproducible from a seed.

Prompts are token-id lists, not text, so every backend (pagedllm, Hugging Face, a server taking ids)
sees exactly ``input_len`` tokens; decoding random ids to text and re-encoding would change the length.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SampledRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Every token id except special tokens (BOS/EOS/chat markers would make prompts unrealistic)."""
    vocab_size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("tokenizer: has no non-special tokens to sample prompts from")
    return ids


def random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                    prefix_len: int = 0, seed: int = 0, num_prefixes: int = 1) -> list[SampledRequest]:
    """``num_prompts`` prompts of exactly ``prefix_len + input_len`` token ids.

    The first ``prefix_len`` ids are a shared prefix (to exercise prefix caching): one of ``num_prefixes``
    different ones (vLLM's prefix-repetition workload: a few system prompts, many users), in shuffled order.
    The rest are drawn uniformly from the non-special vocabulary with ``numpy.random.default_rng(seed)``, so
    the same arguments give the same prompts in every process and for every backend.
    """
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be a positive integer, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    prefixes = [rng.choice(vocab, size=prefix_len).tolist() for _ in range(num_prefixes)]
    bodies = rng.choice(vocab, size=(num_prompts, input_len))
    which = rng.permutation(np.arange(num_prompts) % num_prefixes) if num_prefixes > 1 else np.zeros(num_prompts, int)
    return [SampledRequest(prefixes[int(k)] + row.tolist(), output_len) for k, row in zip(which, bodies)]


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 200) -> None:
    group = parser.add_argument_group("dataset (random token ids)")
    group.add_argument("--num-prompts", type=int, default=num_prompts,
                       help=f"Number of prompts (default: {num_prompts}).")
    group.add_argument("--input-len", type=int, default=128,
                       help="Random tokens per prompt, after the shared prefix (default: 128).")
    group.add_argument("--output-len", type=int, default=128,
                       help="Tokens to generate per prompt; EOS is ignored so every request makes exactly "
                            "this many (default: 128).")
    group.add_argument("--prefix-len", type=int, default=0,
                       help="Length of a random prefix shared by all prompts (default: 0).")
    group.add_argument("--num-prefixes", type=int, default=1,
                       help="Different shared prefixes of --prefix-len tokens; prompt i gets one of them, so the "
                            "prompts come in --num-prefixes groups (default: 1).")
