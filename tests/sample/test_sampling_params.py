import pytest

from pagedllm.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: "x"}}, "logit_bias"),
    ],
)
def test_validation_error_names_field(kwargs, field_name):
    with pytest.raises(ValueError, match=rf"^{field_name}\b"):
        SamplingParams(**kwargs)


def test_logprobs_limit_message_is_clear():
    with pytest.raises(ValueError, match="logprobs must be at most 20, got 21"):
        SamplingParams(logprobs=21)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), logit_bias={"7": 250.0, 8: -1000, "9": 3})
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 6]
    assert p.logit_bias == {7: 100.0, 8: -100.0, 9: 3.0}
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=0).sampling_type == SamplingType.RANDOM_SEED


def test_greedy_resets_truncation():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 2.0
    assert p.stop == ["a"] and p.logit_bias == {1: 1.0}


def test_child_params_seeds():
    p = SamplingParams(n=3, seed=10, stop=["x"])
    children = [p.child_params(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.stop == ["x"] for c in children)
    assert SamplingParams(n=2).child_params(1).seed is None
    with pytest.raises(ValueError, match="index"):
        p.child_params(3)


def test_verify_token_ids():
    SamplingParams(stop_token_ids=[3], logit_bias={4: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).verify_token_ids(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={12: 1.0}).verify_token_ids(10)
