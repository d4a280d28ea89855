"""The KV cache snapshot behind the playground's cache map: block states and owners, no model."""

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_snapshot import NO_OWNER, build_snapshot

from helpers.scheduler import make_request, make_scheduler, run_to_completion

BS = 4


def manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=caching, hash_seed=0)


def allocate(kv: KVCacheManager, rid: str, prompt: list[int]):
    """Admit a request as the scheduler does: prefix hits first, then new blocks for the rest."""
    req = make_request(rid, prompt, max_tokens=4)
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(prompt) - num_hit_tokens, hits, num_hit_tokens) is not None
    req.num_computed_tokens = len(prompt)
    return req


def test_empty_cache_is_null_then_free():
    snap = manager(16).snapshot()
    assert snap.states() == "n" + "f" * 15
    assert snap.runs == (("n", NO_OWNER, 1), ("f", NO_OWNER, 15))
    assert snap.owners == () and snap.num_blocks == 16 and snap.block_size == BS


def test_allocation_marks_blocks_used_by_their_request():
    kv = manager(16)
    a = allocate(kv, "a", list(range(10)))  # 3 blocks
    b = allocate(kv, "b", list(range(100, 105)))  # 2 blocks
    snap = kv.snapshot()
    states, owners = snap.states(), snap.block_owners()
    assert snap.owners == ("a", "b") and snap.owner_num_blocks == (3, 2)
    for index, req in enumerate((a, b)):
        for block_id in kv.get_block_ids(req.request_id)[0]:
            assert states[block_id] == "u" and owners[block_id] == index
    assert snap.count("u") == 5 and snap.count("f") == 10
    assert all(owners[i] == NO_OWNER for i, s in enumerate(states) if s != "u")


def test_freeing_turns_full_blocks_cached_and_the_rest_free():
    kv = manager(16)
    a = allocate(kv, "a", list(range(10)))  # 2 full blocks (hashed) + 1 partial
    ids = kv.get_block_ids("a")[0]
    kv.free(a)
    snap = kv.snapshot()
    states = snap.states()
    assert [states[i] for i in ids] == ["c", "c", "f"]
    assert snap.owners == () and snap.count("u") == 0 and snap.count("c") == 2


def test_no_caching_frees_to_plain_free():
    kv = manager(16, caching=False)
    a = allocate(kv, "a", list(range(10)))
    kv.free(a)
    assert kv.snapshot().states() == "n" + "f" * 15


def test_prefix_hit_shares_blocks_and_first_owner_keeps_them():
    kv = manager(16)
    prompt = list(range(12))  # 3 full blocks; a second request with one more token hits all three
    a = allocate(kv, "a", prompt)
    b = allocate(kv, "b", prompt + [99])
    shared = kv.get_block_ids("b")[0][:3]
    assert shared == kv.get_block_ids("a")[0]
    snap = kv.snapshot()
    states, owners = snap.states(), snap.block_owners()
    assert [states[i] for i in shared] == ["s", "s", "s"]
    assert all(owners[i] == snap.owners.index("a") for i in shared)
    own_b = kv.get_block_ids("b")[0][3:]
    assert len(own_b) == 1
    assert all(states[i] == "u" and owners[i] == snap.owners.index("b") for i in own_b)
    assert snap.owner_num_blocks[snap.owners.index("b")] == 4
    # When the first owner leaves, the survivor holds them alone.
    kv.free(a)
    snap = kv.snapshot()
    assert snap.owners == ("b",) and [snap.states()[i] for i in shared] == ["u", "u", "u"]
    assert all(snap.block_owners()[i] == snap.owners.index("b") for i in shared)
    kv.free(b)
    assert kv.snapshot().count("u") == 0


def test_cached_free_block_hit_becomes_used_again():
    kv = manager(16)
    prompt = list(range(12))
    kv.free(allocate(kv, "a", prompt))
    assert kv.snapshot().count("c") == 3
    allocate(kv, "b", prompt + [7])
    snap = kv.snapshot()
    assert snap.owners == ("b",) and snap.count("c") == 0 and snap.count("u") == 4


def test_eviction_reuses_cached_blocks_lru_first():
    kv = manager(6)  # 5 usable blocks
    kv.free(allocate(kv, "a", list(range(8))))  # 2 cached blocks, 3 free (plain free ones come first)
    allocate(kv, "b", list(range(50, 66)))  # 4 blocks: the 3 free ones, then one cached block evicted
    snap = kv.snapshot()
    assert snap.count("u") == 4 and snap.count("c") == 1 and snap.count("f") == 0


def test_runs_round_trip_and_are_compact():
    states = ["n"] + ["f"] * 1000 + ["u"] * 10 + ["c"] * 5 + ["u"] * 3 + ["f"] * 2000
    tables = {"r1": list(range(1001, 1011)), "r2": list(range(1016, 1019))}
    snap = build_snapshot(states, 16, tables)
    assert snap.states() == "".join(states)
    assert len(snap.runs) == 6
    assert snap.runs[2] == ("u", 0, 10) and snap.runs[4] == ("u", 1, 3)
    owners = snap.block_owners()
    assert owners[1005] == 0 and owners[1017] == 1 and owners[2] == NO_OWNER


def test_null_block_in_a_table_is_not_owned():
    """Sliding-window tables put the null block where freed blocks were."""
    states = ["n", "u", "u", "f"]
    snap = build_snapshot(states, 16, {"r": [0, 0, 1, 2], "gone": [0]})
    assert snap.owners == ("r",) and snap.owner_num_blocks == (2,)
    assert snap.runs == (("n", NO_OWNER, 1), ("u", 0, 2), ("f", NO_OWNER, 1))


def test_snapshot_matches_scheduler_state_through_a_run():
    """Drive the real scheduler (with preemption) and check the snapshot after every step."""
    sched = make_scheduler(num_blocks=12, block_size=4, budget=16, max_seqs=4)
    shared = list(range(8))
    reqs = [make_request(f"r{i}", shared + [100 + i] * (3 + i), max_tokens=10) for i in range(4)]
    arrivals = {0: reqs[:2], 2: reqs[2:]}
    checked = 0
    original_schedule = sched.schedule

    def checking_schedule():
        nonlocal checked
        out = original_schedule()
        snap = sched.kv.snapshot()
        states, owners = snap.states(), snap.block_owners()
        held: dict[int, int] = {}
        for rid, blocks in sched.kv.req_to_blocks.items():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
            if blocks:
                assert rid in snap.owners
        for block_id in range(1, snap.num_blocks):
            refs = held.get(block_id, 0)
            assert states[block_id] == ("u" if refs == 1 else "s" if refs > 1 else states[block_id])
            if refs == 0:
                assert states[block_id] in "fc" and owners[block_id] == NO_OWNER
            else:
                assert snap.owners[owners[block_id]] in sched.kv.req_to_blocks
        assert snap.count("u") + snap.count("s") == snap.num_blocks - 1 - sched.kv.pool.num_free_blocks
        checked += 1
        return out

    sched.schedule = checking_schedule
    outputs, _ = run_to_completion(sched, arrivals)
    assert checked > 5 and all(len(outputs[r.request_id]) == 10 for r in reqs)
    assert sched.num_preemptions > 0  # the run went through preemption too
    final = sched.kv.snapshot()
    assert final.owners == () and final.count("u") == final.count("s") == 0
