"""Which engine gets a request when several serve one endpoint (``--data-parallel-size``).

``DataParallelRouter`` is what ``MultiprocEngine`` asks. For ``prefix-aware`` routing (the default; SGLang's
cache-aware rule, ``engine/router.py``) it computes a prompt's block hashes the way the engines do
(``core/block_hash.py``: sha256 with one seed for all engines, so the values agree across processes) and follows
each engine's prefix cache through the KV cache events the engines publish (``distributed/kv_events.py``): over
private IPC sockets, or over the ``--kv-events-config`` endpoints when the user publishes them anyway, so an
external router sees the same stream. ``least-loaded`` and ``round-robin`` need neither. With one engine every
request goes to engine 0 and nothing is subscribed.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from dataclasses import replace

from pagedllm.config import EngineConfig
from pagedllm.core.block_hash import BlockKeysFn, compute_block_hash_values, root_hash_value
from pagedllm.distributed.kv_events_config import KVEventsConfig
from pagedllm.engine.router import PrefixAwareRouter, RoundRobinRouter
from pagedllm.logger import init_logger

logger = init_logger(__name__)


class DataParallelRouter:
    """Set up before the engines start. ``config`` is the engines' config: the one given, or a copy with the hash
    algorithm, seed and event endpoints that prefix-aware routing needs (the engines must receive this one)."""

    def __init__(self, config: EngineConfig, num_engines: int) -> None:
        self.num_engines = num_engines
        self.config = config
        self.policy = config.parallel.routing if num_engines > 1 else "single"
        self.block_size = config.cache.block_size
        self._ipc_dir: str | None = None
        self._subscriber = None
        self._prefix: PrefixAwareRouter | None = None
        self._round_robin = RoundRobinRouter(num_engines)
        if self.policy != "prefix-aware":
            return
        if not config.cache.enable_prefix_caching:
            logger.info("prefix-aware routing has nothing to follow without prefix caching: least-loaded instead")
            self.policy = "least-loaded"
            return
        cache = config.cache
        if cache.prefix_caching_hash_algo != "sha256":
            logger.info("prefix-aware routing: block hashes use sha256 (Python's hash() differs per process)")
            cache = replace(cache, prefix_caching_hash_algo="sha256")
        if cache.prefix_caching_hash_seed is None:
            # One seed for every engine, still unpredictable.
            cache = replace(cache, prefix_caching_hash_seed=secrets.randbits(63))
        self.hash_algo = cache.prefix_caching_hash_algo
        self.root_value = root_hash_value(cache.prefix_caching_hash_seed, self.hash_algo)
        events = config.kv_events
        if events is None or not events.publishes:
            self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-kv-events-")
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                    endpoint=f"ipc://{self._ipc_dir}/events")
        self.config = replace(config, cache=cache, kv_events=events)
        self.events_config = events
        p = config.parallel
        self._prefix = PrefixAwareRouter(num_engines, p.routing_cache_threshold, p.routing_balance_abs_threshold,
                                         p.routing_balance_rel_threshold)

    def start(self) -> None:
        """Subscribe to the engines' events (once they are up and bound)."""
        if self._prefix is None:
            return
        from pagedllm.distributed.kv_events import KVEventSubscriber, engine_endpoint

        endpoints = [engine_endpoint(self.events_config.endpoint, i) for i in range(self.num_engines)]
        self._subscriber = KVEventSubscriber(endpoints, self.events_config.topic)

    def poll_events(self) -> None:
        """Apply every KV cache event that has arrived (non-blocking)."""
        if self._subscriber is None:
            return
        for engine, batch in self._subscriber.poll(0):
            self._prefix.apply_events(engine, batch)

    def choose(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None, loads: list[int],
               block_keys: BlockKeysFn | None = None) -> int:
        """The engine for a request; ``loads`` are each engine's running + waiting requests (with those routed
        to it since its last report). ``block_keys``: the request's per-block extra hash keys (its LoRA adapter's
        digest, its images: ``Request.block_keys``), so the predicted hashes are the engines' own."""
        if self.num_engines == 1:
            return 0
        if self._prefix is not None:
            self.poll_events()
            hashes = compute_block_hash_values(prompt_token_ids, self.block_size, self.root_value, self.hash_algo,
                                               cache_salt, block_keys)
            return self._prefix.choose(request_id, hashes, loads)
        if self.policy == "round-robin":
            return self._round_robin.choose(request_id, [], loads)
        return min(range(self.num_engines), key=lambda i: (loads[i], i))

    def request_finished(self, request_id: str) -> None:
        """The request left its engine: drop the blocks the router assumed it would cache."""
        if self._prefix is not None:
            self._prefix.request_finished(request_id)

    def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
