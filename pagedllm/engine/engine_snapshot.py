"""Live engine state for the playground's cache view: built on the engine thread, read by the HTTP side.

The engine thread publishes an immutable ``EngineSnapshot`` (KV blocks, scheduler counters, step times)
by swapping one reference, so the HTTP side never touches the scheduler or the block pool. Snapshots are
only built while someone watches (an HTTP read in the last few seconds) and at most every
``min_interval_s`` (stretched so building costs at most ~5% of the loop on a large cache).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pagedllm.core.kv_cache_snapshot import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_SHARED,
    BLOCK_USED,
    KVCacheSnapshot,
)
from pagedllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MIN_INTERVAL_S = 0.15
# A reader counts as watching for this long after its last read.
WATCH_TIMEOUT_S = 5.0
# Building may take at most this share of the engine loop's time.
MAX_OVERHEAD = 0.05


@dataclass(frozen=True)
class StepTimes:
    """Wall time of ``engine.step()`` over the steps since the previous snapshot, in seconds."""

    last: float = 0.0
    mean: float = 0.0
    max: float = 0.0
    num_steps: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    seq: int  # increases by one per published snapshot
    time: float  # wall clock (time.time()) when built
    kv: KVCacheSnapshot
    owner_status: tuple[str, ...]  # per kv.owners entry: "running", "waiting", ...
    owner_num_tokens: tuple[int, ...]  # per kv.owners entry: tokens so far (prompt + output)
    num_running: int
    num_waiting: int
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_steps: int  # cumulative model steps
    step_times: StepTimes = field(default_factory=StepTimes)
    build_time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        kv = self.kv
        usable = max(kv.num_blocks - 1, 1)
        used, shared = kv.count(BLOCK_USED), kv.count(BLOCK_SHARED)
        queries = self.prefix_cache_queries
        return {
            "object": "kv_cache.snapshot",
            "seq": self.seq,
            "time": self.time,
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            # Block ids 0..num_blocks-1 in order, as runs of [state, owner index or -1, count].
            "encoding": "runs",
            "states": {"n": "null (reserved)", "f": "free", "c": "cached, free (prefix cache)",
                       "u": "in use", "s": "in use, shared by several requests"},
            "runs": [list(run) for run in kv.runs],
            "owners": [{"id": rid, "status": status, "num_blocks": nb, "num_tokens": nt}
                       for rid, status, nb, nt in zip(kv.owners, self.owner_status, kv.owner_num_blocks,
                                                       self.owner_num_tokens)],
            "counts": {"free": kv.count(BLOCK_FREE), "cached": kv.count(BLOCK_CACHED), "used": used,
                       "shared": shared},
            "kv_cache_usage": (used + shared) / usable,
            "scheduler": {"running": self.num_running, "waiting": self.num_waiting,
                          "preemptions": self.num_preemptions, "steps": self.num_steps},
            "prefix_cache": {"queries": queries, "hits": self.prefix_cache_hits,
                             "hit_rate": self.prefix_cache_hits / queries if queries else 0.0},
            "step_time_ms": {"last": self.step_times.last * 1e3, "mean": self.step_times.mean * 1e3,
                             "max": self.step_times.max * 1e3, "num_steps": self.step_times.num_steps},
            "snapshot_build_ms": self.build_time_s * 1e3,
        }

    @cached_property
    def json_bytes(self) -> bytes:
        """Encoded once per snapshot, however many clients poll it."""
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()


def build_engine_snapshot(engine: Any, seq: int, step_times: StepTimes) -> EngineSnapshot:
    """Engine thread only. ``engine`` is an ``LLMEngine``."""
    start = time.perf_counter()
    core = engine.core
    sched = core.scheduler
    kv = sched.kv.snapshot()
    statuses, num_tokens = [], []
    for rid in kv.owners:
        request = sched.requests.get(rid)
        statuses.append(request.status.name.lower() if request is not None else "finished")
        num_tokens.append(request.num_tokens if request is not None else 0)
    return EngineSnapshot(
        seq=seq, time=time.time(), kv=kv, owner_status=tuple(statuses), owner_num_tokens=tuple(num_tokens),
        num_running=sched.num_running, num_waiting=sched.num_waiting, num_preemptions=sched.num_preemptions,
        prefix_cache_queries=sched.kv.prefix_cache_queries, prefix_cache_hits=sched.kv.prefix_cache_hits,
        num_steps=core.num_steps, step_times=step_times, build_time_s=time.perf_counter() - start)


class SnapshotPublisher:
    """Owned by ``AsyncLLM``. ``after_step``/``flush``/``publish`` run on the engine thread; ``watch``,
    ``latest`` and ``is_stale`` may be called from any thread."""

    def __init__(self, min_interval_s: float = DEFAULT_MIN_INTERVAL_S) -> None:
        self.min_interval_s = min_interval_s
        self.latest: EngineSnapshot | None = None
        self._watched_until = 0.0
        self._dirty = True  # engine state changed since `latest` was built
        self._last_publish = 0.0
        self._interval_s = min_interval_s
        self._seq = 0
        self._failed = False
        self._window: list[float] = []
        self._last_step = 0.0

    # ---- any thread ----------------------------------------------------------------------------------
    def watch(self) -> None:
        """A reader wants snapshots: keep publishing for the next ``WATCH_TIMEOUT_S`` seconds."""
        self._watched_until = time.monotonic() + WATCH_TIMEOUT_S

    @property
    def watched(self) -> bool:
        return time.monotonic() < self._watched_until

    def is_stale(self) -> bool:
        """True when ``latest`` is missing, or the engine changed since and the loop won't publish soon."""
        latest = self.latest
        if latest is None:
            return True
        return self._dirty and time.monotonic() - self._last_publish > 2 * self._interval_s + 0.5

    # ---- engine thread -------------------------------------------------------------------------------
    def after_step(self, engine: Any, step_time_s: float | None) -> None:
        """After a model step (``step_time_s``) or a batch of commands (None): publish if watched and due."""
        if step_time_s is not None:
            self._window.append(step_time_s)
            self._last_step = step_time_s
            if len(self._window) > 10_000:  # nobody watched for a long time
                del self._window[:5_000]
        self._dirty = True
        if self.watched and time.monotonic() - self._last_publish >= self._interval_s:
            self.publish(engine)

    def flush(self, engine: Any) -> None:
        """The loop is about to idle: publish the final state if someone watches it."""
        if self._dirty and self.watched:
            self.publish(engine)

    def publish(self, engine: Any) -> EngineSnapshot | None:
        if self._failed:
            return self.latest
        window, self._window = self._window, []
        times = StepTimes(self._last_step, sum(window) / len(window), max(window), len(window)) if window \
            else StepTimes(self._last_step)
        try:
            snap = build_engine_snapshot(engine, self._seq + 1, times)
        except Exception:  # never let the map take the engine loop down
            logger.exception("could not build a KV cache snapshot; the cache view is disabled")
            self._failed = True
            return self.latest
        self._seq += 1
        self.latest = snap
        self._dirty = False
        self._last_publish = time.monotonic()
        # Stretch the interval on huge caches so building stays a small share of the loop.
        self._interval_s = max(self.min_interval_s, snap.build_time_s / MAX_OVERHEAD)
        return snap
