from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_hash import hash_block
from pagedllm.core.block_pool import BlockPool


def test_allocate_and_free_returns_everything():
    pool = BlockPool(10, enable_caching=False)
    assert pool.num_free_blocks == 9  # block 0 is the reserved null block
    blocks = pool.get_new_blocks(4)
    assert all(b.ref_cnt == 1 for b in blocks) and 0 not in [b.block_id for b in blocks]
    assert pool.num_free_blocks == 5
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 9 and pool.usage == 0.0


def test_exhaustion_raises():
    pool = BlockPool(4, enable_caching=False)
    pool.get_new_blocks(3)
    try:
        pool.get_new_blocks(1)
    except ValueError as e:
        assert "free" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_double_free_is_caught():
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    try:
        pool.free_blocks([block])
    except RuntimeError:
        pass
    else:
        raise AssertionError("expected RuntimeError")


def test_cached_block_found_until_evicted_lru_order():
    pool = BlockPool(4, enable_caching=True)  # 3 usable blocks
    a, b, c = pool.get_new_blocks(3)
    ha, hb = hash_block(7, (1, 2)), hash_block(7, (3, 4))
    pool.cache_block(a, ha, 7)
    pool.cache_block(b, hb, 7)
    pool.free_blocks([a, b, c])  # LRU order now a, b, c
    assert pool.lookup(ha, 7) is a and pool.lookup(hb, 7) is b
    (first,) = pool.get_new_blocks(1)
    assert first is a and pool.lookup(ha, 7) is None  # evicted lazily on reuse
    assert pool.lookup(hb, 7) is b


def test_hit_checks_tokens_and_parent():
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    h = hash_block(7, (1, 2))
    pool.cache_block(a, h, 7)
    assert pool.lookup(h, 8) is None  # same content after another prefix
    forged = type(h)(h.value, (9, 9), ())
    assert pool.lookup(forged, 7) is None  # hash collision with other tokens


def test_touch_free_hit_leaves_free_queue():
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, hash_block(1, (5,)), 1)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    assert a not in list(pool.free_queue)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]), st.integers(0, 5)), max_size=60))
def test_random_operations_never_leak_or_go_negative(ops):
    pool = BlockPool(8, enable_caching=True)
    held: list = []
    counter = 0
    for op, k in ops:
        if op == "alloc" and pool.num_free_blocks > 0:
            held.extend(pool.get_new_blocks(min(k + 1, pool.num_free_blocks)))
        elif op == "free" and held:
            pool.free_blocks([held.pop(k % len(held))])
        elif op == "cache" and held:
            counter += 1
            pool.cache_block(held[k % len(held)], hash_block(0, (counter,)), 0)
        elif op == "hit" and pool.cached:
            block = list(pool.cached.values())[k % len(pool.cached)]
            pool.touch([block])
            held.append(block)
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        assert pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)
        assert all(pool.cached[h] is b and b.block_hash.value == h for h, b in pool.cached.items())
    pool.free_blocks(held)
    assert pool.num_free_blocks == 7
