"""KV cache events: what the block pool records, and that replaying them gives exactly its cached hashes."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_hash import compute_block_hash_values, hash_block
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    replay_events,
)
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler

from helpers.fake_runner import FakeRunner
from helpers.scheduler import make_request

BS = 4


def manager(num_blocks: int = 16, events: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, hash_seed=0, hash_algo="sha256", enable_kv_cache_events=events)


def admit(kv: KVCacheManager, rid: str, prompt: list[int]):
    req = make_request(rid, prompt, max_tokens=4)
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(prompt) - num_hit, hits, num_hit) is not None
    req.num_computed_tokens = len(prompt)
    return req


def test_recording_is_off_by_default():
    kv = manager(events=False)
    admit(kv, "a", list(range(10)))
    kv.reset_prefix_cache()
    assert kv.take_events() == [] and kv.pool._events is None


def test_a_prompts_full_blocks_are_stored_as_one_chain():
    kv = manager()
    prompt = list(range(10))  # 2 full blocks and a partial one
    req = admit(kv, "a", prompt)
    (stored,) = kv.take_events()
    assert stored == BlockStored(block_hashes=compute_block_hash_values(prompt, BS, kv.root_hash, "sha256", None),
                                 parent_block_hash=None, token_ids=prompt[:8], block_size=BS)
    assert kv.take_events() == []  # taken means cleared
    # Decoding fills the third block: stored with the second as its parent.
    for token in (10, 11):  # two decode steps, as the scheduler runs them
        req.append_output_token(token)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    (more,) = kv.take_events()
    assert more.block_hashes == [req.block_hashes[2].value] and more.parent_block_hash == stored.block_hashes[-1]
    assert more.token_ids == [8, 9, 10, 11]


def test_a_prefix_hit_or_a_duplicate_block_stores_nothing_new():
    kv = manager()
    admit(kv, "a", list(range(9)))
    kv.take_events()
    admit(kv, "b", list(range(9)))  # hits a's two blocks; its partial block is not full
    assert kv.take_events() == []


def test_reuse_of_a_cached_block_removes_its_hash():
    kv = manager(num_blocks=4)  # 3 usable blocks
    a = admit(kv, "a", list(range(9)))  # 3 blocks, 2 of them cached
    (stored,) = kv.take_events()
    kv.free(a)  # tail first: the partial block, then block 1, block 0 join the free queue
    admit(kv, "b", list(range(100, 109)))  # needs all 3 blocks: both cached ones are evicted lazily
    events = kv.take_events()
    assert events[0] == BlockRemoved(block_hashes=list(reversed(stored.block_hashes)))
    assert isinstance(events[1], BlockStored) and not kv.pool.cached.keys() & set(stored.block_hashes)


def test_uncache_and_reset():
    kv = manager()
    a = admit(kv, "a", list(range(13)))  # 3 cached blocks
    stored = kv.take_events()[0].block_hashes
    kv.uncache_from(a, 4)  # a failed step: blocks past the first are no longer trusted
    assert kv.take_events() == [BlockRemoved(block_hashes=stored[1:])]
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_a_batch_round_trips_through_msgpack():
    batch = KVEventBatch(ts=1.5, events=[BlockStored([2**64 - 1, -5], None, [1, 2, 3, 4, 5, 6, 7, 8], 4),
                                         BlockRemoved([7]), AllBlocksCleared()], data_parallel_rank=1)
    raw = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(raw, type=KVEventBatch) == batch
    assert msgspec.msgpack.decode(raw)[1][0][0] == "BlockStored"  # tagged, array-like (vLLM's layout)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit", "uncache", "reset"]),
                          st.integers(0, 5)), max_size=60))
def test_pool_replay_matches_cached_hashes(ops):
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    held: list = []
    replayed: set[int] = set()
    counter = 0
    for op, k in ops:
        if op == "alloc" and pool.num_free_blocks > 0:
            held.extend(pool.get_new_blocks(min(k + 1, pool.num_free_blocks)))
        elif op == "free" and held:
            pool.free_blocks([held.pop(k % len(held))])
        elif op == "cache" and held:
            counter += 1
            pool.cache_block(held[k % len(held)], hash_block(k % 3, (counter % 4,), algo="sha256"), k % 3,
                             parent_is_root=k == 0)
        elif op == "hit" and pool.cached:
            block = list(pool.cached.values())[k % len(pool.cached)]
            pool.touch([block])
            held.append(block)
        elif op == "uncache" and held:
            pool.uncache(held[k % len(held)])
        elif op == "reset":
            pool.reset_prefix_cache()
        if k % 2:  # take events at random points: batches split anywhere must still replay
            replay_events(replayed, pool.take_events())
    replay_events(replayed, pool.take_events())
    assert replayed == set(pool.cached)


request_st = st.tuples(st.integers(0, 12), st.integers(1, 30), st.integers(1, 8), st.integers(0, 2))


@settings(max_examples=60, deadline=None)
@given(st.lists(request_st, min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["reset", "abort", "fail"])), max_size=6))
def test_scheduler_workload_replay_matches_cached_hashes(requests, disturbances):
    """Random arrivals sharing prefixes, preemption (a small cache), aborts, failed steps and resets."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64),
                      CacheConfig(block_size=BS, num_blocks=24, prefix_caching_hash_seed=0,
                                  prefix_caching_hash_algo="sha256"), enable_kv_cache_events=True)
    runner = FakeRunner(24, BS)
    arrivals: dict[int, list] = {}
    for i, (arrive, plen, max_tokens, family) in enumerate(requests):
        arrivals.setdefault(arrive, []).append(make_request(f"r{i}", [family * 50 + j for j in range(plen)],
                                                            max_tokens))
    at = dict(disturbances)
    replayed: set[int] = set()
    for step in range(400):
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if at.get(step) == "reset":
            sched.kv.reset_prefix_cache()
        elif at.get(step) == "abort" and sched.requests:
            sched.finish_requests([sorted(sched.requests)[0]], RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished_requests() and step > max(arrivals):
            break
        out = sched.schedule()
        if at.get(step) == "fail" and out.num_scheduled_tokens:
            for rid in out.finished_req_ids | out.preempted_req_ids:
                runner.state.pop(rid, None)
            sched.recover_from_failed_step(out)
        else:
            sched.update_from_output(out, runner.execute(out))
        replay_events(replayed, sched.kv.take_events())
        assert replayed == set(sched.kv.pool.cached)
