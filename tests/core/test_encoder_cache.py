"""The scheduler's image handling, with no model: the encoder cache's bound and eviction, images budgeted per
step, chunks cut before an image that cannot be encoded, image-aware block hashes."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_hash import compute_block_hash_values
from pagedllm.core.encoder_cache import EncoderCacheManager
from pagedllm.core.multimodal import MultiModalFeature, multimodal_block_keys
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

IMG = 999  # placeholder token id


def _scheduler(budget: int = 32, cache_rows: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                                     encoder_cache_size=cache_rows),
                     CacheConfig(block_size=4, enable_prefix_caching=caching, num_blocks=64,
                                 prefix_caching_hash_seed=0))


def _request(rid: str, images: list[tuple[str, int]], text: int = 2) -> Request:
    """``text`` tokens, then each image (hash, tokens) followed by ``text`` tokens."""
    prompt, features = list(range(1, text + 1)), []
    for identifier, length in images:
        features.append(MultiModalFeature(identifier, len(prompt), length))
        prompt += [IMG] * length + list(range(1, text + 1))
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    return Request(rid, prompt, params, [], 4, mm_features=features)


def _finish_step(sched: Scheduler, out) -> None:
    """Sample one token for every request that caught up with its prompt."""
    from pagedllm.core.sched_output import ModelRunnerOutput

    tokens = {r: [7] for r in out.num_scheduled_tokens
              if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=tokens))


def test_cache_evicts_only_unused_entries_oldest_first() -> None:
    cache = EncoderCacheManager(capacity=30)
    cache.allocate("a", 10, "r1")
    cache.allocate("b", 10, "r2")
    assert not cache.can_allocate(11)  # both in use
    cache.release("a", "r1")
    cache.release("b", "r2")
    cache.use("a", "r3")  # a is needed again: b is now the only evictable entry
    assert cache.can_allocate(20) and not cache.can_allocate(21)
    cache.allocate("c", 20, "r3")
    assert cache.take_freed() == ["b"]
    assert cache.has("a") and cache.has("c") and not cache.has("b")
    assert cache.num_free == 0


def test_images_cost_the_encoder_budget_and_cut_the_chunk() -> None:
    """Budget 20: the first image (16) is encoded, the second (16) must wait for the next step."""
    sched = _scheduler(budget=20)
    sched.add_request(_request("r", [("x", 16), ("y", 16)]))
    out = sched.schedule()
    assert out.num_scheduled_tokens["r"] == 2 + 16 + 2  # stops right before image y
    assert sched.encoder_cache.has("x") and not sched.encoder_cache.has("y")
    _finish_step(sched, out)
    out = sched.schedule()
    assert sched.encoder_cache.has("y")
    assert sched.encoder_cache.num_allocations == 2


def test_a_shared_image_is_encoded_once_and_freed_when_nobody_needs_it() -> None:
    sched = _scheduler(budget=64, cache_rows=32)
    sched.add_request(_request("a", [("x", 16)]))
    sched.add_request(_request("b", [("x", 16)]))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert sched.encoder_cache.num_allocations == 1
    # Both computed past the image: it stays cached but evictable.
    assert sched.encoder_cache.unused == {"x": 16}
    while sched.has_unfinished_requests():
        _finish_step(sched, out)
        out = sched.schedule()
    sched.add_request(_request("c", [("y", 16)]))
    sched.add_request(_request("d", [("z", 16)]))
    out = sched.schedule()
    assert out.free_encoder_hashes == ["x"]  # evicted to make room, and the runner is told
    assert sched.encoder_cache.num_free == 0


def test_a_request_waits_while_the_encoder_cache_is_held_by_others() -> None:
    """Room for one image: a's second image and b's image wait until a no longer needs its first."""
    sched = _scheduler(budget=64, cache_rows=16)
    sched.add_request(_request("a", [("x", 16), ("w", 16)]))
    sched.add_request(_request("b", [("y", 16)]))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 20, "b": 2}  # each up to its image that finds the cache full
    _finish_step(sched, out)
    out = sched.schedule()  # a is past x now: w takes its place
    assert out.free_encoder_hashes == ["x"]
    assert out.num_scheduled_tokens == {"a": 18}
    assert sched.encoder_cache.has("w") and not sched.encoder_cache.has("y")


def test_an_image_that_can_never_fit_is_refused() -> None:
    sched = _scheduler(budget=8)
    with pytest.raises(ValueError, match="more than one step's budget"):
        sched.add_request(_request("r", [("x", 16)]))


def test_block_hashes_cover_the_image_and_its_place() -> None:
    prompt = [1, 2] + [IMG] * 8 + [3, 4]
    a = [MultiModalFeature("aaa", 2, 8)]
    b = [MultiModalFeature("bbb", 2, 8)]

    def values(features):
        return compute_block_hash_values(prompt, 4, 0, "sha256", None,
                                         lambda s, e: multimodal_block_keys(features, s, e))

    assert values(a) == values([MultiModalFeature("aaa", 2, 8)])
    assert values(a)[0] != values(b)[0]  # every block holding image tokens differs
    assert multimodal_block_keys(a, 0, 4) == ("aaa", 2)
    assert multimodal_block_keys(a, 8, 12) == ("aaa", -6)
    assert multimodal_block_keys(a, 12, 16) == ()
    assert values(a) != compute_block_hash_values(prompt, 4, 0, "sha256", None)  # text-only hashes differ too
