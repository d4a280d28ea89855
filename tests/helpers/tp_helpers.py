"""Shared by the tensor-parallel tests: tiny models, fixed prompts, greedy runs of an offline engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers.arch_configs import save_tiny

PROMPTS = [[5 + i, 17, 33, 40 + i, 9, 100, 3 * i + 7, 12, 200, 42, 13, 77, 8, 19, 60, 61, 62, 63, 20 + i]
           for i in range(3)]


def tiny(arch: str, root: Path) -> str:
    path, _ = save_tiny(arch, root / arch, seed=3)
    return path


def greedy(model: str, tensor_parallel_size: int, max_tokens: int = 12, **kwargs: Any) -> list[list[int]]:
    """Greedy tokens of PROMPTS (prompts longer than the tiny sliding window of 16) on a fresh engine, closed after."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tensor_parallel_size, kv_cache_memory="16MiB", max_model_len=128,
              dtype="float32", **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.core.close()
