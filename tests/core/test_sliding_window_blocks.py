"""An all-sliding model's blocks that fell out of the window are swapped for the null block and freed."""

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def test_block_manager_frees_blocks_outside_the_window() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True, hash_seed=0, sliding_window=8)
    req = Request("r", list(range(100, 130)), SamplingParams(max_tokens=200), [2], 200)
    assert kv.allocate_slots(req, 30) is not None  # the whole prompt: 8 blocks
    req.num_computed_tokens = 30
    for _ in range(40):  # decodes
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        live = [b for b in kv.req_to_blocks["r"] if b is not kv.pool.null_block]
        # Blocks ending before num_computed_tokens - window are gone: at most window/bs + 2 remain.
        assert len(live) <= 8 // 4 + 2
    assert kv.req_to_blocks["r"][0] is kv.pool.null_block
    kv.free(req)
    assert kv.pool.num_free_blocks == kv.num_usable_blocks


def test_without_a_window_nothing_is_freed() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    req = Request("r", list(range(30)), SamplingParams(max_tokens=50), [2], 50)
    kv.allocate_slots(req, 30)
    req.num_computed_tokens = 30
    for _ in range(20):
        req.append_output_token(7)
        kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert kv.pool.null_block not in kv.req_to_blocks["r"] and len(kv.req_to_blocks["r"]) == 13
