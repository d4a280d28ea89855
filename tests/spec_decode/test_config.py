import pytest

from pagedllm.spec_decode.config import parse_speculative_config
from pagedllm.spec_decode.ngram_proposer import NgramProposer


def test_vllm_keys_parse() -> None:
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert cfg.num_lookahead_tokens == 0
    cfg = parse_speculative_config({"model": "/some/draft", "num_speculative_tokens": 5})
    assert cfg.method == "draft_model" and cfg.num_lookahead_tokens == 5
    assert cfg.disable_by_batch_size == 8  # off under load by default
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, '
                                    '"disable_by_batch_size": null}').disable_by_batch_size is None
    cfg = parse_speculative_config({"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 4,
                                    "disable_by_batch_size": 8})
    assert (cfg.num_draft_layers, cfg.disable_by_batch_size) == (4, 8)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("raw, field", [
    ("{", "JSON"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "layer_skip", "num_speculative_tokens": 2}, "num_draft_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown"),
    ([1, 2], "JSON object"),
])
def test_bad_configs_name_the_field(raw, field) -> None:
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(raw)


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([9, 1, 7, 8, 1, 5, 6, 1]) == [5, 6, 1]  # latest occurrence of "1"
    assert p.propose([1, 2, 3, 1, 2], k=1) == [3]
    assert NgramProposer(k=3, min_n=2, max_n=3).propose([1, 2, 3, 4, 2]) == []  # a 1-gram is too short
