"""Continuous batching must not change greedy outputs: together == alone, also under pressure."""

import pytest

from pagedllm import LLM, SamplingParams

from helpers.prompts import PROMPTS

# Runs the default model (the session's `llm`, and engines of its own). Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def solo_outputs(llm: LLM) -> list[list[int]]:
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def _batched(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_batched_equals_solo(llm: LLM, solo_outputs):
    assert _batched(llm) == solo_outputs


def test_batched_equals_solo_under_preemption_and_chunking(solo_outputs):
    # ~12 blocks of 16 tokens for 16 requests of ~20 tokens each: preemption is unavoidable;
    # a 24-token budget splits every prompt into chunks that share steps with decodes.
    tight = LLM(kv_cache_memory="9MiB", max_num_batched_tokens=24, max_model_len=256, dtype="float32")
    outs = _batched(tight)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert outs == solo_outputs
    assert tight.engine.core.scheduler.kv.usage == 0.0


def test_prefix_caching_on_equals_off(llm: LLM):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 6
    prompts = [shared + q for q in ("What is 2+2?", "Name a colour.", "Who wrote Hamlet?")]
    prompts.append(prompts[0])  # the whole prompt cached
    prompts.append(shared[:37])  # a prefix that ends mid-block
    off = LLM(enable_prefix_caching=False, kv_cache_memory="64MiB", max_model_len=1024, dtype="float32")
    want = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warm the cache
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert got[0].num_cached_tokens > 0


def test_cache_salt_keeps_tenants_apart(llm: LLM):
    prompt = "Shared system prompt for every tenant of this service. " * 4
    llm.generate(prompt, GREEDY, use_tqdm=False)
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    salted = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and salted.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert salted.outputs[0].token_ids == plain.outputs[0].token_ids
