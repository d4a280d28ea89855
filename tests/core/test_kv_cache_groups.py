"""KV cache groups of a hybrid model: the sliding group keeps only the window's blocks while the full group
keeps the whole context; allocation, prefix hits, preemption and abort work over both groups."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.worker.kv_cache_groups import sliding_group_blocks_wanted, split_kv_budget

from helpers.fake_runner import FakeRunner, reference_output
from helpers.scheduler import make_request, random_arrivals, run_to_completion

BS, WINDOW = 4, 8


def hybrid(num_blocks: int = 64, sliding_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=caching, hash_seed=0, sliding_group=(sliding_blocks, WINDOW))


def live(kv: KVCacheManager, group: int, rid: str) -> list:
    g = kv.groups[group]
    return [b for b in g.req_to_blocks.get(rid, []) if b is not g.pool.null_block]


def all_free(kv: KVCacheManager) -> bool:
    return all(g.pool.num_free_blocks == g.num_usable_blocks and not g.req_to_blocks for g in kv.groups)


def decode(kv: KVCacheManager, req, steps: int) -> None:
    for _ in range(steps):
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def test_one_kind_of_layer_keeps_one_group() -> None:
    kv = KVCacheManager(16, BS, hash_seed=0)
    req = make_request("r", list(range(10)), 4)
    new = kv.allocate_slots(req, 10)
    assert len(kv.groups) == 1 and len(new) == 1 and kv.get_block_ids("r") == ([b.block_id for b in new[0]],)
    assert kv.sliding_group_usage is None


def test_sliding_group_stays_within_the_window_while_the_full_group_grows() -> None:
    kv = hybrid()
    req = make_request("r", list(range(100, 130)), 200)
    new = kv.allocate_slots(req, 30)
    assert [len(g) for g in new] == [8, 8]  # the prompt's chunk writes all its tokens before attending
    req.num_computed_tokens = 30
    for _ in range(40):
        decode(kv, req, 1)
        assert len(live(kv, 1, "r")) <= WINDOW // BS + 2
    assert len(live(kv, 0, "r")) == 18  # 71 tokens: every block of the full group
    # metrics see both: usage is the full group's, sliding_group_usage the window's few blocks
    assert kv.usage == pytest.approx(18 / 63) and kv.sliding_group_usage == pytest.approx(len(live(kv, 1, "r")) / 15)
    full_ids, sliding_ids = kv.get_block_ids("r")
    assert len(full_ids) == len(sliding_ids) and sliding_ids[0] == 0  # null where the window no longer looks
    kv.free(req)
    assert all_free(kv)


def test_allocation_takes_nothing_unless_every_group_has_room() -> None:
    kv = hybrid(num_blocks=64, sliding_blocks=4)  # 3 usable sliding blocks
    big = make_request("big", list(range(20)), 4)
    assert kv.allocate_slots(big, 20) is None  # 5 blocks: the full group has room, the sliding group not
    assert all_free(kv)
    small = make_request("small", list(range(12)), 4)
    assert kv.allocate_slots(small, 12) is not None
    assert kv.groups[0].pool.num_free_blocks == 63 - 3 and kv.groups[1].pool.num_free_blocks == 0


def test_prefix_hit_needs_only_the_window_in_the_sliding_group() -> None:
    kv = hybrid(sliding_blocks=64)
    prompt = list(range(200, 241))  # 41 tokens: 10 full blocks can hit
    a = make_request("a", prompt, 4)
    assert kv.allocate_slots(a, 41) is not None
    a.num_computed_tokens = 41
    kv.free(a)
    # Evict the sliding group's copies of the first blocks: a full-attention group could not hit now.
    for block in kv.groups[1].pool.blocks[1:]:
        if block.block_hash is not None and block.block_hash.token_ids[0] < 212:
            kv.groups[1].pool.uncache(block)
    b = make_request("b", prompt, 4)
    hits, num_tokens = kv.get_computed_blocks(b)
    assert num_tokens == 40
    assert len(hits[0]) == len(hits[1]) == 10
    null = kv.groups[1].pool.null_block
    assert hits[1][:8] == [null] * 8 and null not in hits[1][8:]  # the window at position 40: blocks 8, 9
    assert kv.allocate_slots(b, 1, hits, num_tokens) is not None
    assert len(live(kv, 1, "b")) == 3 and len(live(kv, 0, "b")) == 11
    # An evicted block inside the window shortens the hit until the window is cached again.
    kv.free(b)
    for block in kv.groups[1].pool.blocks[1:]:
        if block.block_hash is not None and block.block_hash.token_ids[0] == 236:
            kv.groups[1].pool.uncache(block)
    _, num_tokens = kv.get_computed_blocks(make_request("c", prompt, 4))
    assert num_tokens < 40
    assert all_free(kv)


def test_uncache_and_reset_cover_both_groups() -> None:
    kv = hybrid()
    req = make_request("r", list(range(16)), 4)
    kv.allocate_slots(req, 16)
    assert all(len(g.pool.cached) == 4 for g in kv.groups)
    kv.uncache_from(req, 8)
    assert all(len(g.pool.cached) == 2 for g in kv.groups)
    assert kv.reset_prefix_cache() == 4
    kv.free(req)
    assert all_free(kv)


def test_sliding_group_sizing() -> None:
    # Per request ceil(8 / 4) + 2 = 4 blocks, 3 requests, one step's 32 tokens (8 blocks), the null block.
    assert sliding_group_blocks_wanted(8, 4, 32, 3) == 21
    # One request alone always fits: its peak is ceil((8 + 32) / 4) + 1 = 11 blocks.
    assert sliding_group_blocks_wanted(8, 4, 32, 1) - 1 >= 11
    assert split_kv_budget(1000, 10, 5, 34) == (83, 34)  # 34 * 5 = 170 bytes for the sliding group
    assert split_kv_budget(300, 10, 5, 34) == (20, 20)  # too small: never more sliding than full blocks


def hybrid_scheduler(num_blocks: int, budget: int, max_seqs: int, caching: bool, lookahead: int = 0,
                     sliding_blocks: int | None = None) -> Scheduler:
    wanted = sliding_group_blocks_wanted(WINDOW, BS, budget, max_seqs, lookahead)
    cache = CacheConfig(block_size=BS, enable_prefix_caching=caching, num_blocks=num_blocks,
                        prefix_caching_hash_seed=0, sliding_group_window=WINDOW,
                        sliding_group_num_blocks=sliding_blocks or min(wanted, num_blocks))
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64,
                                      num_lookahead_tokens=lookahead), cache)
    sched.__dict__["_fake_runner"] = FakeRunner(num_blocks, BS, num_drafts=lookahead, draft_error_rate=0.3,
                                                window=WINDOW,
                                                sliding_num_blocks=cache.sliding_group_num_blocks,
                                                sliding_tables=sched.kv.groups[1].req_to_blocks)
    return sched


def test_the_fake_runner_catches_a_sliding_group_that_frees_too_much() -> None:
    """The checks below could fail: a sliding group that frees a block its window still sees is caught."""
    prompts = {"a": list(range(30)), "b": list(range(500, 520))}

    def run(window: int):
        sched = hybrid_scheduler(num_blocks=64, budget=16, max_seqs=2, caching=False, sliding_blocks=12)
        for group in sched.kv.groups[1:]:
            group.sliding_window = window
        arrivals = {0: [make_request("a", prompts["a"], 30)], 3: [make_request("b", prompts["b"], 30)]}
        return run_to_completion(sched, arrivals)[0]

    outputs = run(WINDOW)
    assert all(outputs[r] == reference_output(p, 30) for r, p in prompts.items())
    with pytest.raises(AssertionError, match="freed"):
        run(WINDOW - 2)  # two positions short: frees a block the oldest visible key sits in


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 15), st.integers(1, 40), st.integers(1, 16), st.integers(0, 3)),
             min_size=1, max_size=10),
    st.integers(12, 48), st.integers(4, 24), st.integers(1, 5), st.booleans(), st.sampled_from([0, 3]))
def test_random_workloads_through_both_groups(reqs, num_blocks, budget, max_seqs, caching, lookahead):
    """Random arrivals with shared prefixes on a tight cache (preemption), with or without drafts in
    lookahead slots: every token read through the sliding group's window is right, and every block of both
    groups comes back."""
    sched = hybrid_scheduler(num_blocks, budget, max_seqs, caching, lookahead)
    arrivals, expected = random_arrivals(sched, reqs)
    outputs, _ = run_to_completion(sched, arrivals)
    for rid, tokens in expected.items():
        got = outputs.get(rid, [])
        if sched._finish_reasons[rid] == "length" and len(got) < len(tokens):
            assert got == tokens[:len(got)]  # alone, it outgrew the whole (full group's) cache
        else:
            assert got == tokens
    assert all_free(sched.kv)
    assert all(b.ref_cnt == 0 for g in sched.kv.groups for b in g.pool.blocks[1:])


def test_abort_returns_both_groups_blocks() -> None:
    from pagedllm.core.request import RequestStatus

    sched = hybrid_scheduler(num_blocks=32, budget=8, max_seqs=2, caching=True)
    sched.add_request(make_request("a", list(range(30)), 20))
    for _ in range(6):
        sched.schedule()  # no outputs fed back: the prompt stays mid-prefill
    assert live(sched.kv, 0, "a") and live(sched.kv, 1, "a")
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert all_free(sched.kv)


def test_layers_split_into_groups_by_attention_spec() -> None:
    from pagedllm.attention.spec import AttentionSpec, kv_cache_groups

    causal, local = AttentionSpec.causal(), AttentionSpec.sliding(512)
    assert kv_cache_groups([local] * 5 + [causal] + [local] * 2) == ([1] * 5 + [0] + [1] * 2, 512)
    assert kv_cache_groups([causal] * 3) == ([0, 0, 0], None)
    assert kv_cache_groups([local] * 3) == ([0, 0, 0], None)  # all sliding: one group that frees (Mistral)
    # Sliding layers of two windows: one group, nothing freed (correct, just no saving).
    assert kv_cache_groups([local, AttentionSpec.sliding(256), causal]) == ([0, 0, 0], None)
    assert kv_cache_groups([AttentionSpec.encoder()] * 2) == ([], None)
