"""Which engine of a data-parallel group serves a request: prefix-aware (SGLang's cache-aware rule) or round robin.

Pure logic, no torch and no sockets: the API-side client feeds it each engine's KV cache events
(``apply_events``, from ``distributed/kv_events.KVEventSubscriber``) and load, and asks ``choose`` with the
request's block hashes (``core/block_hash.compute_block_hash_values`` with the engines' seed and ``sha256``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedllm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class RoundRobinRouter:
    """Engines in turn, whatever the prompt or the loads (the baseline for comparisons)."""

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        self.num_engines = num_engines
        self._next = 0

    def choose(self, request_id: str, block_hashes: list[int], loads: list[int]) -> int:
        engine = self._next
        self._next = (self._next + 1) % self.num_engines
        return engine

    def apply_events(self, engine_index: int, batch: KVEventBatch) -> None:
        """Round robin ignores the caches."""

    def request_finished(self, request_id: str) -> None:
        """Round robin keeps no per-request state."""


@dataclass
class _Routed:
    """A routed request whose prompt blocks count as the engine's until it finishes or its TTL ends."""

    request_id: str
    engine: int
    block_hashes: list[int]
    deadline: float


class PrefixAwareRouter:
    """SGLang's cache-aware rule over the block hashes each engine holds.

    1. Loads imbalanced (``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``): the
       least loaded engine.
    2. Else the engine holding the longest run of the prompt's leading block hashes, if that run is more than
       ``cache_threshold`` of the prompt's blocks (ties: the least loaded of them).
    3. Else the least loaded engine (SGLang takes the one with the smallest cache tree; load is what we know).

    Ties between equally loaded engines rotate, so a burst of unrelated prompts arriving before the loads move
    still spreads. An engine holds a hash if its events stored it, or if a request routed to it since (not
    finished, younger than ``pending_ttl_s``) has it: a burst sharing a prefix sticks to one engine before the
    first prefill's events arrive. ``loads`` are the engines' queued + running requests, ideally counting the
    ones routed since each engine last reported.
    """

    def __init__(self, num_engines: int, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, pending_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.num_engines = num_engines
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.pending_ttl_s = pending_ttl_s
        self._clock = clock
        self._cached: list[set[int]] = [set() for _ in range(num_engines)]
        self._pending: list[dict[int, int]] = [{} for _ in range(num_engines)]  # hash -> routed requests with it
        self._routed: dict[str, _Routed] = {}
        self._expiry: deque[_Routed] = deque()  # in routing order = deadline order (one TTL)
        self._tie = 0

    # ---- what the engines report ------------------------------------------------------------------------
    def apply_events(self, engine_index: int, batch: KVEventBatch) -> None:
        """Follow one of the engine's event batches (in the order it published them)."""
        cached = self._cached[engine_index]
        for event in batch.events:
            if isinstance(event, BlockStored):
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear_engine(engine_index)

    def clear_engine(self, engine_index: int) -> None:
        """Forget everything the engine holds (its cache was reset, or it restarted)."""
        self._cached[engine_index].clear()
        for routed in [r for r in self._routed.values() if r.engine == engine_index]:
            self._drop(routed)

    def request_finished(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed): its blocks are now known from events only."""
        routed = self._routed.get(request_id)
        if routed is not None:
            self._drop(routed)

    # ---- the decision -----------------------------------------------------------------------------------
    def choose(self, request_id: str, block_hashes: list[int], loads: list[int]) -> int:
        """The engine for a request with these full-block hashes, given each engine's load."""
        if len(loads) != self.num_engines:
            raise ValueError(f"loads: expected {self.num_engines} values, got {len(loads)}")
        self._expire()
        self.request_finished(request_id)  # routed again (e.g. a retry): the new choice replaces the old
        engine = self._pick(block_hashes, loads)
        if block_hashes:
            routed = _Routed(request_id, engine, list(block_hashes), self._clock() + self.pending_ttl_s)
            self._routed[request_id] = routed
            self._expiry.append(routed)
            pending = self._pending[engine]
            for h in routed.block_hashes:
                pending[h] = pending.get(h, 0) + 1
        return engine

    def match_length(self, engine_index: int, block_hashes: list[int]) -> int:
        """How many of the leading block hashes the engine holds (cached or pending), up to the first miss."""
        cached, pending = self._cached[engine_index], self._pending[engine_index]
        n = 0
        for h in block_hashes:
            if h not in cached and h not in pending:
                break
            n += 1
        return n

    def num_cached_blocks(self, engine_index: int) -> int:
        """Block hashes the engine's events say it holds."""
        return len(self._cached[engine_index])

    def _pick(self, block_hashes: list[int], loads: list[int]) -> int:
        engines = range(self.num_engines)
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return self._least_loaded(loads, engines)
        if block_hashes:
            matches = [self.match_length(i, block_hashes) for i in engines]
            best = max(matches)
            if best / len(block_hashes) > self.cache_threshold:
                return self._least_loaded(loads, [i for i in engines if matches[i] == best])
        return self._least_loaded(loads, engines)

    def _least_loaded(self, loads: list[int], candidates: Iterable[int]) -> int:
        candidates = list(candidates)
        lowest = min(loads[i] for i in candidates)
        ties = [i for i in candidates if loads[i] == lowest]
        self._tie += 1
        return ties[self._tie % len(ties)]

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0].deadline <= now:
            routed = self._expiry.popleft()
            if self._routed.get(routed.request_id) is routed:  # not finished or re-routed meanwhile
                self._drop(routed)

    def _drop(self, routed: _Routed) -> None:
        del self._routed[routed.request_id]
        pending = self._pending[routed.engine]
        for h in routed.block_hashes:
            left = pending[h] - 1
            if left:
                pending[h] = left
            else:
                del pending[h]
        routed.block_hashes = []  # the expiry queue may hold the record until its deadline
