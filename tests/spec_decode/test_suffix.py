"""Suffix decoding: the index drafts what an explicit suffix tree would, the proposer learns from finished
outputs, and greedy outputs with it equal those without (alone, batched, all drafts accepted or rejected)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ENGINE

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.config import SuffixSettings, parse_speculative_config
from pagedllm.spec_decode.proposer import DraftJob
from pagedllm.spec_decode.suffix_index import SEPARATOR, SuffixIndex
from pagedllm.spec_decode.suffix_proposer import GlobalOutputs, SuffixProposer


class _TreeNode:
    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _TreeNode] = {}


def _explicit_tree(sequences: list[list[int]], depth: int) -> _TreeNode:
    """The reference: every substring of up to ``depth`` tokens of each sequence as a path, counted."""
    root = _TreeNode()
    for seq in sequences:
        for start in range(len(seq)):
            node = root
            for token in seq[start:start + depth]:
                node = node.children.setdefault(token, _TreeNode())
                node.count += 1
    return root


def _explicit_draft(root: _TreeNode, pattern: list[int], depth: int, max_tokens: int, factor: float,
                    min_prob: float) -> tuple[list[int], float]:
    best: tuple[list[int], float] = ([], 0.0)
    for m in range(1, min(len(pattern), depth - 1) + 1):
        node = root
        for token in pattern[-m:]:
            node = node.children.get(token)
            if node is None:
                break
        if node is None:
            break
        drafted, prob, score = [], 1.0, 0.0
        for _ in range(min(max_tokens, int(factor * m), depth - m)):
            if not node.children:
                break
            # The most frequent child; ties to the smallest token, as np.unique sorts.
            token, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            prob *= child.count / sum(c.count for c in node.children.values())  # occurrences that go on
            if prob < min_prob:
                break
            drafted.append(token)
            score += prob
            node = child
        if score > best[1]:
            best = (drafted, score)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_index_drafts_what_an_explicit_suffix_tree_drafts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    motifs = [rng.integers(0, 12, size=rng.integers(3, 9)).tolist() for _ in range(4)]
    seq: list[int] = []
    while len(seq) < 300:  # repeated motifs with noise: many matches of many lengths
        seq += motifs[rng.integers(0, 4)] if rng.random() < 0.8 else rng.integers(0, 12, size=2).tolist()
    depth = int(rng.integers(4, 12))
    for end in range(20, len(seq), 23):
        body, pattern = seq[:end], seq[:end][-(depth - 1):]
        index = SuffixIndex()
        index.extend(body)
        root = _explicit_tree([body], depth)
        for factor, min_prob in ((1.0, 0.1), (0.5, 0.3), (2.0, 0.0)):
            got = index.draft(pattern, depth, 8, factor, min_prob)
            want = _explicit_draft(root, pattern, depth, 8, factor, min_prob)
            assert (got.tokens, round(got.score, 9)) == (want[0], round(want[1], 9))


def test_a_separator_ends_matches_and_drafts() -> None:
    index = SuffixIndex()
    index.extend([1, 2, 3, SEPARATOR, 1, 2, 9, 9, SEPARATOR])
    draft = index.draft([1, 2], max_depth=8, max_tokens=4, max_spec_factor=4.0, min_token_prob=0.0)
    assert draft.tokens[0] in (3, 9) and SEPARATOR not in draft.tokens
    assert index.draft([3], 8, 4, 4.0, 0.0).tokens == []  # nothing follows 3 but the separator


def _job(req_id: str, tokens: list[int], num_prompt: int, k: int = 8) -> DraftJob:
    return DraftJob(req_id, tokens, [], len(tokens), len(tokens), k, 0.0, None, num_prompt)


def test_finished_outputs_draft_for_later_requests() -> None:
    proposer = SuffixProposer(8, SuffixSettings(max_tree_depth=16))
    prompt, answer = [50, 51, 52], [7, 8, 9, 10, 11, 12, 13, 14]
    assert proposer.propose_one(_job("a", prompt + answer[:2], 3)) == []  # nothing to copy yet
    proposer.propose_one(_job("a", prompt + answer, 3))
    proposer.forget("a")  # finished: its output joins the global index
    assert "a" not in proposer.requests
    # Another request, another prompt, the same first two answer tokens: the rest is drafted from "a".
    assert proposer.propose_one(_job("b", [60, 61, 7, 8], 2, k=4)) == [9, 10]  # 2 matched x factor 1.0
    assert proposer.propose_one(_job("b", [60, 61, 7, 8, 9, 10], 2)) == [11, 12, 13, 14]


def test_global_outputs_keep_the_newest_and_stay_bounded() -> None:
    outputs = GlobalOutputs(max_requests=3)
    for i in range(50):
        outputs.add(str(i), [1000 + i] * 5)
    assert list(outputs.outputs) == ["47", "48", "49"]
    assert len(outputs.index) <= 2 * 3 * 6  # rebuilt once half of it was dropped outputs
    assert outputs.index.draft([1049, 1049], 8, 3, 2.0, 0.0).tokens == [1049, 1049, 1049]
    assert outputs.index.draft([1000], 8, 3, 2.0, 0.0).tokens == []  # evicted


def test_config_keys_and_defaults() -> None:
    cfg = parse_speculative_config({"method": "suffix"})
    assert cfg.num_speculative_tokens == 24 == cfg.suffix.max_tree_depth  # vLLM's default: the tree depth
    assert cfg.num_lookahead_tokens == 0  # a lookup writes no K/V
    cfg = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 6,
                                    "suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_spec_factor": 2,
                                    "suffix_decoding_min_token_prob": 0.25,
                                    "suffix_decoding_max_cached_requests": 0})
    assert (cfg.num_speculative_tokens, cfg.suffix) == (6, SuffixSettings(32, 0, 2.0, 0.25))
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        parse_speculative_config({"method": "suffix", "suffix_decoding_min_token_prob": 1.5})
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth"):
        parse_speculative_config({"method": "suffix", "suffix_decoding_max_tree_depth": 1})
    with pytest.raises(ValueError, match="applies to method 'suffix' only"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "suffix_decoding_max_tree_depth": 8})


SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "auto_disable": False}
PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42, 5, 17, 300, 42, 5, 17]},
           {"prompt_token_ids": [9, 8, 7, 6]},
           {"prompt_token_ids": [100, 200, 100, 200, 100, 200, 100]}]


def _ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_and_suffix(tiny_models) -> tuple[LLM, LLM]:
    return LLM(tiny_models["target"], **ENGINE), LLM(tiny_models["target"], **ENGINE, speculative_config=SUFFIX)


def test_greedy_equal_alone_and_batched(plain_and_suffix) -> None:
    plain, suffix = plain_and_suffix
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _ids(plain, PROMPTS, params)
    assert [_ids(suffix, [p], params)[0] for p in PROMPTS] == expected
    assert _ids(suffix, PROMPTS, params) == expected
    assert suffix.engine.core.scheduler.spec_stats.num_drafts > 0


def test_a_repeated_request_is_drafted_whole_from_the_global_tree(plain_and_suffix) -> None:
    plain, suffix = plain_and_suffix
    prompt = [{"prompt_token_ids": [33, 44, 55, 66, 77]}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = _ids(plain, prompt, params)
    assert _ids(suffix, prompt, params) == expected
    stats = suffix.engine.core.scheduler.spec_stats
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert _ids(suffix, prompt, params) == expected  # the same request again: its last answer is in the tree
    new_drafts, new_accepted = stats.num_draft_tokens - drafts, stats.num_accepted_tokens - accepted
    assert new_drafts > 0 and new_accepted == new_drafts  # every draft accepted
    assert new_accepted >= 32  # most of the 48 tokens came from drafts (short matches draft few at first)


def test_drafts_all_rejected_leave_the_output_unchanged(plain_and_suffix, monkeypatch) -> None:
    plain, suffix = plain_and_suffix
    real = SuffixProposer.propose_one

    def wrong(self, job):  # every draft one off the real one: all rejected
        return [(t + 1) % 512 for t in real(self, job)]

    monkeypatch.setattr(SuffixProposer, "propose_one", wrong)
    prompt = [{"prompt_token_ids": [33, 44, 55, 66, 77]}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    stats = suffix.engine.core.scheduler.spec_stats
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert _ids(suffix, prompt, params) == _ids(plain, prompt, params)
    assert stats.num_draft_tokens > drafts and stats.num_accepted_tokens == accepted


def test_get_metrics_reports_acceptance(plain_and_suffix) -> None:
    """The offline counters (vLLM's ``LLM.get_metrics``): accepted <= drafted <= drafts x k, and the accepted
    count by position falls with the position."""
    _, suffix = plain_and_suffix
    _ids(suffix, PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    metrics = {m.name: m for m in suffix.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert 0 < accepted <= drafted <= drafts * SUFFIX["num_speculative_tokens"]
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert metrics["vllm:num_requests_running"].value == 0
