"""Sampling, stopping and outputs through the whole engine on the default model."""

import pytest

from pagedllm import LLM, SamplingParams

from helpers.prompts import PROMPTS

# Runs the default model (the session's `llm`). Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow


def test_max_tokens_and_length_finish(llm: LLM):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert out.finished and out.metrics.first_token_time >= out.metrics.arrival_time


def test_stop_string_cuts_text(llm: LLM):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert "6" in text, text
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=12, stop=["6"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index("6")] and out.finish_reason == "stop" and out.stop_reason == "6"
    kept = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=12, stop=["6"],
                                                      include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == text[:text.index("6") + 1]


def test_stop_token_ids(llm: LLM):
    greedy = llm.generate(PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop_at = greedy.token_ids[3]
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_seeded_sampling_is_reproducible_in_any_batch(llm: LLM):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    mixed = llm.generate([PROMPTS[2], PROMPTS[1], PROMPTS[3]], [others, params, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_n_samples_and_logprobs(llm: LLM):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2, ignore_eos=True)
    out = llm.generate(PROMPTS[4], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and len(entry) >= 2 and entry[tok].logprob <= 0
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_prompt_logprobs(llm: LLM):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in entry


def test_token_id_prompt_and_chat(llm: LLM):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[0])
    a = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    b = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt is None
    chat = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0.0, max_tokens=8),
                    use_tqdm=False)[0]
    assert chat.outputs[0].text.strip()


def test_multibyte_text_streams_whole_characters(llm: LLM):
    out = llm.generate("Écris une phrase en français avec des accents : été, çà, où.",
                       SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert "\ufffd" not in out.text
