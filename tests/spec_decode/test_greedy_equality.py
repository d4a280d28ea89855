"""Greedy outputs with speculative decoding equal those without, for every method, solo and batched,
including stop strings, stop/EOS tokens and max_tokens that fall inside an accepted run of drafts."""

import pytest
from conftest import ENGINE

from pagedllm import LLM, SamplingParams

REPEAT_PROMPT = ("Repeat this text exactly: The quick brown fox jumps over the lazy dog. The quick brown fox "
                 "jumps over the lazy dog.\nAnswer:")
PROMPTS = [REPEAT_PROMPT, "1, 2, 3, 4, 5, 6, 7, 8,", "The capital of France is"]


def _ids(llm: LLM, prompts, params) -> list[tuple[list[int], str, str | None]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def base_llm(need_default_model) -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def ngram_llm(need_default_model) -> LLM:
    return LLM(**ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_min": 2, "prompt_lookup_max": 4})


@pytest.fixture(scope="module")
def plain_repeat(base_llm: LLM) -> tuple[list[int], str, str | None]:
    return _ids(base_llm, [REPEAT_PROMPT], SamplingParams(temperature=0, max_tokens=32))[0]


@pytest.mark.slow  # the default model, like each test marked slow below
def test_ngram_greedy_equals_plain_solo_and_batched(base_llm: LLM, ngram_llm: LLM, plain_repeat) -> None:
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = _ids(base_llm, PROMPTS, params)
    assert expected[0] == plain_repeat  # batching does not change plain greedy outputs either
    stats = ngram_llm.engine.core.scheduler.spec_stats
    before = stats.num_accepted_tokens
    assert _ids(ngram_llm, [REPEAT_PROMPT], params)[0] == expected[0]
    assert stats.num_accepted_tokens > before + 10  # the repeated passage was drafted and accepted
    assert _ids(ngram_llm, PROMPTS, params) == expected


@pytest.mark.slow
def test_ngram_stop_conditions_inside_accepted_runs(base_llm: LLM, ngram_llm: LLM, plain_repeat) -> None:
    tokens, text = plain_repeat[0], plain_repeat[1]
    # A stop string, a stop token and max_tokens that all end in the middle of the repeated passage,
    # where n-gram drafts are long and accepted; all in one batch, next to an unrelated request.
    cases = [
        SamplingParams(temperature=0, max_tokens=32, stop=["lazy"]),
        SamplingParams(temperature=0, max_tokens=32, stop=["brown fox jumps over the lazy dog.\n"]),
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[tokens[13]]),
        SamplingParams(temperature=0, max_tokens=13),
        SamplingParams(temperature=0, max_tokens=32, stop=["lazy"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=20),
    ]
    prompts = [REPEAT_PROMPT] * 5 + [PROMPTS[1]]
    expected = _ids(base_llm, prompts, cases)
    assert _ids(ngram_llm, prompts, cases) == expected
    assert expected[0][2] == "stop" and expected[0][1] == text[:text.index("lazy")]
    assert len(expected[3][0]) == 13 and expected[3][2] == "length"
    assert _ids(ngram_llm, [REPEAT_PROMPT], cases[0])[0] == expected[0]


@pytest.mark.slow
def test_ngram_eos_inside_an_accepted_run(base_llm: LLM, ngram_llm: LLM) -> None:
    # The chat prompt has "<|im_end|>" right after the sentence, so once the model has repeated the
    # sentence the lookup drafts the end-of-sequence token as well.
    messages = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat."}]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = base_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    spec = ngram_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == "stop"
    assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)


@pytest.mark.slow
def test_ngram_with_penalties_and_logprobs_matches(base_llm: LLM, ngram_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2, min_tokens=4, logprobs=2,
                            logit_bias={264: 1.5})
    plain = base_llm.generate([REPEAT_PROMPT], params, use_tqdm=False)[0].outputs[0]
    spec = ngram_llm.generate([REPEAT_PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    assert len(spec.logprobs) == len(plain.logprobs)
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert set(a) == set(b)
        for tid in a:
            assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-3) and a[tid].rank == b[tid].rank


@pytest.fixture(scope="module")
def tiny_base(tiny_models) -> LLM:
    return LLM(tiny_models["target"], **ENGINE)


TINY_PROMPTS = [[5, 17, 300, 42, 42, 9], [100, 101, 102], list(range(200, 260)), [7] * 20]


@pytest.mark.parametrize("method", ["draft_same", "draft_other", "layer_skip"])
def test_model_drafters_greedy_equals_plain(tiny_models, tiny_base: LLM, method: str) -> None:
    cfg = {"draft_same": {"method": "draft_model", "model": tiny_models["target"], "num_speculative_tokens": 3},
           "draft_other": {"method": "draft_model", "model": tiny_models["draft"], "num_speculative_tokens": 4},
           "layer_skip": {"method": "layer_skip", "num_draft_layers": 2, "num_speculative_tokens": 3}}[method]
    llm = LLM(tiny_models["target"], **ENGINE, speculative_config=cfg)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _ids(tiny_base, prompts, params)
    assert _ids(llm, prompts, params) == expected
    assert [_ids(llm, [p], params)[0] for p in prompts] == expected
    # A stop token and max_tokens inside the run, and a request that shares the step unspeculated.
    stop_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[expected[0][0][11]])
    short = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    mixed = [stop_params, short, params, short]
    assert _ids(llm, prompts, mixed) == _ids(tiny_base, prompts, mixed)
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_drafts > 0
    if method == "draft_same":
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # the target drafting for itself
    elif method == "draft_other":
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_draft_model_with_prefix_caching_and_chunked_prefill(tiny_models, tiny_base: LLM) -> None:
    llm = LLM(tiny_models["target"], **{**ENGINE, "max_num_batched_tokens": 16},
              speculative_config={"method": "draft_model", "model": tiny_models["draft"],
                                  "num_speculative_tokens": 3})
    shared = list(range(300, 340))
    prompts = [{"prompt_token_ids": shared + [i, i + 1]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _ids(tiny_base, prompts, params)
    assert _ids(llm, prompts, params) == expected
    assert _ids(llm, prompts, params) == expected  # second time from the prefix cache
    assert llm.engine.core.scheduler.kv.prefix_cache_hits > 0


@pytest.mark.parametrize("method", ["draft_model", "layer_skip"])
def test_preemption_with_speculation_keeps_outputs(tiny_models, tiny_base: LLM, method: str) -> None:
    cfg = {"draft_model": {"method": "draft_model", "model": tiny_models["draft"], "num_speculative_tokens": 3},
           "layer_skip": {"method": "layer_skip", "num_draft_layers": 2, "num_speculative_tokens": 3}}[method]
    # 9 (draft model: its own caches share each block's bytes) or 10 (layer skip) usable blocks of 16 tokens:
    # four requests growing to ~70 tokens (5 blocks) each cannot all stay resident even once a tight step
    # drops its drafts (which it does before preempting anyone).
    memory = {"draft_model": "240KiB", "layer_skip": "176KiB"}[method]
    llm = LLM(tiny_models["target"], **{**ENGINE, "kv_cache_memory": memory}, speculative_config=cfg)
    prompts = [{"prompt_token_ids": [11 + i] * 10 + list(range(40 + i, 60 + i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _ids(llm, prompts, params) == _ids(tiny_base, prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0
