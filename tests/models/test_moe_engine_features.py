"""A MoE model with the engine's other features: n-gram and dense-draft speculation (drafts verified in
multi-row steps through the experts) and prefix caching give the plain greedy tokens; a LoRA adapter on the
attention projections equals transformers + peft; DeepSeek's latent attention with prefix caching and speculation
too."""

from __future__ import annotations

import pytest
import torch

from helpers.moe_configs import save_tiny_deepseek, save_tiny_moe

# Repeats (n-gram drafts get accepted) and one without.
PROMPTS = [[1, *range(10, 22), *range(10, 22), *range(10, 17)], [1, 7, 99, 3, 42, 8, 7, 99, 3], [1, 250, 13, 77]]
NEW_TOKENS = 10
ENGINE = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": None, "auto_disable": False}


def _greedy(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], object]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, **ENGINE, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize("family", ["qwen3moe", "deepseek-v3"])
def test_speculation_and_prefix_caching_keep_the_greedy_tokens(family: str, tmp_path) -> None:
    if family == "qwen3moe":
        path, _ = save_tiny_moe("qwen3moe-e8-top3", tmp_path / family)
    else:
        path, _ = save_tiny_deepseek("v3", tmp_path / family)
    plain, _ = _greedy(path, PROMPTS)
    drafted, llm = _greedy(path, PROMPTS, speculative_config=NGRAM)
    assert drafted == plain
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0  # drafts were verified in multi-row steps
    cached, llm = _greedy(path, PROMPTS + PROMPTS, enable_prefix_caching=True)
    assert cached == plain + plain
    assert llm.engine.core.scheduler.kv.prefix_cache_hits > 0  # the second copies read cached blocks


def test_lora_on_the_attention_of_a_moe_equals_peft(tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.lora.request import LoRARequest

    from helpers.lora_helpers import make_adapter

    path, _ = save_tiny_moe("qwen2moe-e8-top4-shared", tmp_path / "moe")
    adapter = make_adapter(path, tmp_path / "adapter", targets=["q_proj", "v_proj", "o_proj"],
                           model_cls=AutoModelForCausalLM, seed=3)
    plain, _ = _greedy(path, PROMPTS)
    llm = LLM(path, **ENGINE, enable_lora=True, max_loras=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False,
                        lora_request=LoRARequest("a", 1, adapter))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter).eval()
    want = []
    for prompt in PROMPTS:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        want.append(ids[len(prompt):])
    assert ours == want
    assert ours != plain  # the adapter mattered


def test_a_dense_draft_model_keeps_the_moe_greedy_tokens(tmp_path) -> None:
    """A small dense model of the same vocabulary drafts for a MoE target; verification runs k + 1 rows a request
    through the experts."""
    from helpers.arch_configs import save_tiny

    path, _ = save_tiny_moe("qwen3moe-e8-top3", tmp_path / "moe")
    draft, _ = save_tiny("Qwen2ForCausalLM", tmp_path / "draft", seed=1)
    plain, _ = _greedy(path, PROMPTS)
    drafted, llm = _greedy(path, PROMPTS, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None,
        "auto_disable": False})
    assert drafted == plain
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0
