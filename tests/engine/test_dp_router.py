"""The API side's DataParallelRouter: it makes the engines' hashes agree, subscribes to their events, and routes
by them; model-free (real KV cache managers and ZMQ sockets, no model)."""

from __future__ import annotations

import time

from pagedllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import KVEventBatch
from pagedllm.core.multimodal import MultiModalFeature
from pagedllm.core.request import Request
from pagedllm.distributed.kv_events import engine_endpoint, make_event_publisher
from pagedllm.engine.dp_router import DataParallelRouter
from pagedllm.sampling_params import SamplingParams

BLOCK = 4


def _config(num_engines: int, routing: str = "prefix-aware") -> EngineConfig:
    return EngineConfig(model=ModelConfig(), cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                        scheduler=SchedulerConfig(max_model_len=256), device=DeviceConfig(),
                        parallel=ParallelConfig(data_parallel_size=num_engines, routing=routing))


def test_prefix_aware_sets_one_stable_hash_for_every_engine() -> None:
    router = DataParallelRouter(_config(2), 2)
    config = router.config  # the engines' config: the configs are frozen, the router hands on a copy
    try:
        assert config.cache.prefix_caching_hash_algo == "sha256"
        assert config.cache.prefix_caching_hash_seed is not None
        assert config.kv_events is not None and config.kv_events.publishes
        assert config.kv_events.endpoint.startswith("ipc://")  # private: nothing reachable from outside
    finally:
        router.close()


def test_one_engine_and_other_policies_need_no_events() -> None:
    for n, routing in ((1, "prefix-aware"), (2, "round-robin"), (2, "least-loaded")):
        router = DataParallelRouter(_config(n, routing), n)
        config = router.config
        assert config.kv_events is None and config.cache.prefix_caching_hash_algo == "builtin"
        router.close()
    rr = DataParallelRouter(_config(2, "round-robin"), 2)
    assert [rr.choose(f"r{i}", [1, 2, 3], None, [0, 0]) for i in range(4)] in ([1, 0, 1, 0], [0, 1, 0, 1])
    least = DataParallelRouter(_config(3, "least-loaded"), 3)
    assert least.choose("x", [1], None, [5, 2, 9]) == 1


def test_routes_to_the_engine_whose_events_hold_the_prefix() -> None:
    router = DataParallelRouter(_config(2), 2)
    config = router.config
    publishers = [make_event_publisher(config.kv_events, i) for i in range(2)]
    # Each engine's KV cache manager, with the hash settings the router put in the config.
    managers = [KVCacheManager(64, BLOCK, True, config.cache.prefix_caching_hash_seed,
                               hash_algo=config.cache.prefix_caching_hash_algo, enable_kv_cache_events=True)
                for _ in range(2)]
    try:
        router.start()
        prompt = list(range(100, 100 + 8 * BLOCK))  # 8 full blocks
        request = Request("warm", prompt, SamplingParams(max_tokens=1), [], 1)
        kv = managers[1]
        assert kv.allocate_slots(request, len(prompt)) is not None  # full blocks are cached as they are allocated
        events = kv.take_events()
        assert events, "caching a prompt's full blocks records BlockStored events"
        # PUB/SUB joins late: publish until the router has seen engine 1's blocks.
        deadline = time.monotonic() + 10
        while router._prefix.num_cached_blocks(1) == 0:
            assert time.monotonic() < deadline, "the router never received engine 1's events"
            publishers[1].publish(KVEventBatch(time.time(), events))
            time.sleep(0.05)
            router.poll_events()
        # A new request with that prefix goes to engine 1 even though engine 0 is idle; another does not.
        assert router.choose("a", prompt + [7, 8, 9], None, [0, 1]) == 1
        assert router.choose("b", list(range(900, 900 + 8 * BLOCK)), None, [0, 1]) == 0
        # Images: the router's hashes cover them as the engine's do. The same tokens with the same picture go to
        # engine 1; with another picture only the block before the image matches, and they do not.
        image_prompt = list(range(500, 500 + 8 * BLOCK))
        warm = Request("warm-img", image_prompt, SamplingParams(max_tokens=1), [], 1,
                       mm_features=[MultiModalFeature("picture-a", BLOCK, 2 * BLOCK)])
        before = router._prefix.num_cached_blocks(1)
        assert kv.allocate_slots(warm, len(image_prompt)) is not None
        events = kv.take_events()
        deadline = time.monotonic() + 10
        while router._prefix.num_cached_blocks(1) == before:
            assert time.monotonic() < deadline, "the router never received engine 1's image blocks"
            publishers[1].publish(KVEventBatch(time.time(), events))
            time.sleep(0.05)
            router.poll_events()
        same = Request("c", image_prompt + [7], SamplingParams(max_tokens=1), [], 1,
                       mm_features=[MultiModalFeature("picture-a", BLOCK, 2 * BLOCK)])
        other = Request("d", image_prompt + [7], SamplingParams(max_tokens=1), [], 1,
                        mm_features=[MultiModalFeature("picture-b", BLOCK, 2 * BLOCK)])
        assert router.choose("c", same.prompt_token_ids, None, [0, 1], same.block_keys) == 1
        assert router.choose("d", other.prompt_token_ids, None, [0, 1], other.block_keys) == 0
    finally:
        for p in publishers:
            p.close()
        router.close()
    assert engine_endpoint(config.kv_events.endpoint, 1).endswith("-1")
