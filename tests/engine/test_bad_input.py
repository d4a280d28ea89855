import pytest

from pagedllm import LLM, SamplingParams


@pytest.mark.slow  # the default model (the session's `llm`), like each test marked slow below
def test_empty_prompt(llm: LLM):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams(), use_tqdm=False)


@pytest.mark.slow
def test_too_long_prompt(llm: LLM):
    with pytest.raises(ValueError, match="1024"):
        llm.generate([list(range(5, 1100))], SamplingParams(), use_tqdm=False)
    # The engine is still usable afterwards and nothing leaked.
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.slow
def test_out_of_vocab_token_id(llm: LLM):
    with pytest.raises(ValueError, match="token id"):
        llm.generate([[1, 10**7]], SamplingParams(), use_tqdm=False)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"top_k": -5}, "top_k"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not found"):
        LLM(model="/nonexistent/model-folder")


@pytest.mark.slow
def test_mismatched_params_list(llm: LLM):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
