"""The prefix-aware router: shared prefixes stick to one engine, load balance wins past the thresholds, and its
view follows the engines' KV cache events."""

from __future__ import annotations

import random

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_hash import compute_block_hash_values, root_hash_value
from pagedllm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.router import PrefixAwareRouter, RoundRobinRouter

from helpers.fake_runner import FakeRunner
from helpers.scheduler import make_request

A = [101, 102, 103, 104]  # block hashes of two unrelated prompts
B = [201, 202, 203, 204]


def stored(hashes: list[int]) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, [0] * 4 * len(hashes), 4)])


def router_with(a_on: int = 0, b_on: int = 1, **kwargs) -> PrefixAwareRouter:
    router = PrefixAwareRouter(2, **kwargs)
    router.apply_events(a_on, stored(A))
    router.apply_events(b_on, stored(B))
    return router


def test_shared_prefixes_stick_to_the_engine_that_holds_them():
    router = router_with()
    # A longer prompt that starts with A's blocks, while engine 0 is a little busier: still engine 0.
    assert router.choose("r1", A + [105, 106], loads=[10, 0]) == 0
    assert router.choose("r2", B, loads=[0, 10]) == 1
    assert router.match_length(0, A + [999]) == 4 and router.match_length(1, A) == 0


def test_a_small_match_falls_back_to_the_least_loaded_engine():
    router = router_with(cache_threshold=0.3)
    assert router.choose("r1", A[:1] + [7, 8, 9], loads=[3, 2]) == 1  # 1/4 <= 0.3: not worth it
    assert router.choose("r2", A[:2] + [7, 8], loads=[3, 2]) == 0  # 2/4 > 0.3


@pytest.mark.parametrize("loads, balanced", [([64, 0], False), ([65, 0], True), ([200, 134], False),
                                             ([200, 133], True), ([1000, 940], False)])
def test_balance_needs_both_thresholds(loads, balanced):
    router = router_with()  # engine 0 holds A; engine 1 is the least loaded in every case
    assert router.choose("r", A, loads=loads) == (1 if balanced else 0)


def test_no_engine_idles_while_another_queues_past_the_threshold():
    """Every request shares one prefix (a skewed workload): it piles onto one engine until the balance rule
    moves new ones to the other, so neither sits idle while the other has a queue."""
    router = PrefixAwareRouter(2)
    hashes = list(range(1, 20))
    queues = [0, 0]
    arrivals_per_tick, served_per_tick = 12, 5
    routed = [0, 0]
    for tick in range(200):
        for n in range(arrivals_per_tick):
            engine = router.choose(f"r{tick}-{n}", hashes, loads=list(queues))
            queues[engine] += 1
            routed[engine] += 1
        for i in range(2):
            if queues[i] == 0:
                assert max(queues) <= router.balance_abs_threshold + arrivals_per_tick, (tick, queues)
            queues[i] = max(0, queues[i] - served_per_tick)
        if tick == 0:
            router.apply_events(routed.index(max(routed)), stored(hashes))  # the first prefill's blocks
    assert min(routed) > 0.3 * sum(routed)


def test_removed_blocks_move_routing():
    router = router_with()
    router.apply_events(0, KVEventBatch(ts=0.0, events=[BlockRemoved([A[0]])]))
    assert router.match_length(0, A) == 0  # the chain is broken at its first block
    assert router.choose("r", A, loads=[5, 1]) == 1
    assert router.num_cached_blocks(0) == 3


def test_all_blocks_cleared_empties_the_engines_view():
    router = router_with()
    router.choose("pending", A + [105], loads=[0, 0])
    router.apply_events(0, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert router.num_cached_blocks(0) == 0 and router.match_length(0, A) == 0
    assert router.num_cached_blocks(1) == 4  # the other engine is untouched


def test_pending_hashes_make_a_burst_stick_before_any_event():
    router = PrefixAwareRouter(3)
    prefix = [1, 2, 3, 4, 5, 6]
    first = router.choose("r0", prefix + [100], loads=[0, 0, 0])
    # The loads the client knows lag behind (all zero here): the burst still follows the pending hashes.
    assert {router.choose(f"r{i}", prefix + [100 + i], loads=[0, 0, 0]) for i in range(1, 10)} == {first}
    # Unrelated short prompts rotate over equally loaded engines instead of piling onto one.
    assert {router.choose(f"s{i}", [], loads=[0, 0, 0]) for i in range(3)} == {0, 1, 2}
    for i in range(10):
        router.request_finished(f"r{i}")
    assert router.match_length(first, prefix) == 0  # no events confirmed them: nothing is known any more


def test_pending_hashes_expire_after_the_ttl():
    now = [0.0]
    router = PrefixAwareRouter(2, pending_ttl_s=5.0, clock=lambda: now[0])
    first = router.choose("r0", [1, 2, 3], loads=[0, 0])
    now[0] = 4.0
    assert router.choose("r1", [1, 2, 3], loads=[0, 0]) == first
    now[0] = 7.0
    router.choose("x", [], loads=[0, 0])  # each choice expires what is due: r0, not r1 (routed at 4.0)
    assert router.match_length(first, [1, 2, 3]) == 3
    now[0] = 9.5
    router.choose("y", [], loads=[0, 0])
    assert router.match_length(first, [1, 2, 3]) == 0


def test_round_robin_and_argument_checks():
    rr = RoundRobinRouter(3)
    assert [rr.choose(str(i), A, [0, 0, 0]) for i in range(5)] == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="loads"):
        PrefixAwareRouter(2).choose("r", A, loads=[0])


def _serve(router, num_engines: int, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """Route prompts over model-free engines (scheduler + fake runner, sha256 hashes, KV events): the
    prefix-cache hit rate and the requests per engine. The router computes each prompt's hashes itself, as the
    API process would."""
    bs, seed = 4, 7
    engines = [Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                         CacheConfig(block_size=bs, num_blocks=200, prefix_caching_hash_seed=seed,
                                     prefix_caching_hash_algo="sha256"), enable_kv_cache_events=True)
               for _ in range(num_engines)]
    runners = [FakeRunner(200, bs) for _ in engines]
    counts = [0] * num_engines
    root = root_hash_value(seed, "sha256")
    for n in range(len(prompts) + 100):
        if n < len(prompts):
            rid = f"r{n}"
            engine = router.choose(rid, compute_block_hash_values(prompts[n], bs, root, "sha256", None),
                                   [e.num_running + e.num_waiting for e in engines])
            engines[engine].add_request(make_request(rid, prompts[n], max_tokens=2))
            counts[engine] += 1
        for i, sched in enumerate(engines):  # one step of every engine per arrival
            out = sched.schedule()
            for o in sched.update_from_output(out, runners[i].execute(out)):
                if o.finished:
                    router.request_finished(o.req_id)
            router.apply_events(i, KVEventBatch(ts=0.0, events=sched.kv.take_events()))
    assert not any(e.has_unfinished_requests() for e in engines)
    queries = sum(e.kv.prefix_cache_queries for e in engines)
    return sum(e.kv.prefix_cache_hits for e in engines) / queries, counts


def test_routing_by_events_keeps_the_single_engine_hit_rate():
    # 8 system prompts of 40 tokens x 6 users with 6 tokens each, in a random order (in a fixed rotation, round
    # robin would send each system prompt to one engine by chance).
    prompts = [[1000 * s + t for t in range(40)] + [50_000 + 10 * u + s + t for t in range(6)]
               for u in range(6) for s in range(8)]
    random.Random(0).shuffle(prompts)
    one, _ = _serve(PrefixAwareRouter(1), 1, prompts)
    prefix_aware, counts = _serve(PrefixAwareRouter(2), 2, prompts)
    round_robin, _ = _serve(RoundRobinRouter(2), 2, prompts)
    assert one > 0.6
    assert prefix_aware >= one - 0.1 * one and min(counts) >= 12  # and both engines work
    assert round_robin < prefix_aware - 0.05  # every system prompt is computed on both engines
