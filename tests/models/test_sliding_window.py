"""Sliding-window attention: outputs past the window match transformers, and an all-sliding model (Mistral)
keeps only the window's KV blocks alive (the block manager's rule alone: tests/core/test_sliding_window_blocks.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_args import EngineArgs

from helpers.arch_configs import WINDOW, hf_greedy, save_tiny

BLOCK = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny("MistralForCausalLM", tmp_path_factory.mktemp("mistral_sw"), seed=5)


def test_window_is_what_makes_outputs_match(mistral) -> None:
    """The same weights without the window give other logits past it: the test below could fail."""
    from transformers import MistralForCausalLM

    path, hf = mistral
    ids = torch.randint(3, 256, (3 * WINDOW,), generator=torch.Generator().manual_seed(0))
    full = MistralForCausalLM.from_pretrained(path, sliding_window=None, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = hf(ids[None]).logits[0], full(ids[None]).logits[0]
    assert torch.allclose(a[:WINDOW], b[:WINDOW], atol=1e-5)
    assert (a[WINDOW:] - b[WINDOW:]).abs().max() > 1e-2


@pytest.mark.slow  # a long request beside transformers: about 20 s on 2 cores
def test_long_request_matches_transformers_and_kv_stays_bounded(mistral) -> None:
    path, hf = mistral
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="4MiB",
                                                   block_size=BLOCK, max_num_batched_tokens=32))
    kv = engine.core.scheduler.kv
    assert kv.sliding_window == WINDOW
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=60,
                                                                           ignore_eos=True))
    peak, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        held = [b for b in kv.req_to_blocks.get("long", []) if b is not kv.pool.null_block]
        peak = max(peak, len(held))
    # The window plus the block being filled, plus a chunk of up to 32 new tokens during prefill.
    assert peak <= -(-(WINDOW + 32) // BLOCK) + 1, peak
    assert kv.pool.num_free_blocks == kv.num_usable_blocks  # everything back after the request
    tokens = [o for o in outputs if o.finished][0].outputs[0].token_ids
    assert list(tokens) == hf_greedy(hf, prompt, 60)


def test_gemma3_batched_equals_solo(tmp_path) -> None:
    """A hybrid (5 local : 1 global) model: greedy tokens of prompts batched together equal each run alone."""
    from pagedllm import LLM

    from helpers.arch_configs import save_tiny

    path, _ = save_tiny("Gemma3ForCausalLM", tmp_path / "g3", seed=7)
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK, max_num_batched_tokens=48)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 30, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, batched, strict=True):
        solo = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == list(solo.outputs[0].token_ids)
