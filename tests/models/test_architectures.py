"""Every supported architecture vs transformers on a tiny random model loaded from an HF folder:
a whole prompt, chunked prefill + paged decodes (past the sliding window where there is one), and greedy
tokens through the engine."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.attention import attention_layers
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.arch_configs import WINDOW, hf_greedy, save_tiny
from helpers.model_helpers import chunked_prefill_and_decodes, prefill_logits

ARCHS = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM",
         "GPT2LMHeadModel"]
ATOL = 2e-4


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path, hf = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32"))
    assert mc.architecture == request.param
    return request.param, path, hf, load_model(mc, torch.device("cpu"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_matches_transformers(tiny) -> None:
    _, _, hf, model = tiny
    ids = _ids(40, seed=1)  # longer than the sliding window
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    """Request A: prefill in two chunks, then decodes past the window; B joins mid-way and shares steps."""
    _, _, hf, model = tiny
    a, b = _ids(30, seed=2), _ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, _hf_logits(hf, b), atol=ATOL, rtol=0)


@pytest.mark.slow  # generate() next to the engine for every architecture: about a minute in all on 2 cores
def test_engine_greedy_matches_transformers(tiny) -> None:
    """Greedy tokens through the whole engine (scheduler, runner, sampler), three prompts batched."""
    from pagedllm import LLM, SamplingParams

    arch, path, hf, _ = tiny
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=64)
    prompts = [_ids(n, seed=10 + n) for n in (5, 23, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 12), arch


def test_layer_specs_follow_the_config(tiny) -> None:
    arch, _, _, model = tiny
    specs = [m.spec for m in attention_layers(model)]
    if arch == "MistralForCausalLM":
        assert all(s.kind == "sliding" and s.window == WINDOW for s in specs)
    elif arch == "Gemma3ForCausalLM":
        assert [s.kind for s in specs] == ["sliding"] * 5 + ["causal"]
    else:
        assert all(s.kind == "causal" for s in specs)
