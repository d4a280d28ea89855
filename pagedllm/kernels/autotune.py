"""The CPU kernel autotuner's table: which candidate kernel each matmul shape runs, per number of rows.

A kernel tuned on one CPU can lose on the next (one 4-bit decode kernel beat llama.cpp on one CPU and lost to it
on another: docs/performance.md), and the fastest kernel for one decode stream (M = 1, bound by weight
bytes) is not the fastest for a 200-request batch (compute-bound). So the choice is measured on the machine at
hand: for every shape class (a format, N, K, group) and every bucket of rows, each candidate is timed on
random inputs and the fastest kept. The table is saved per machine fingerprint (CPU model and flags, threads,
torch version, the kernels' build name), so later starts skip the timing; a table from another fingerprint is
ignored and measured again.

A measurement can be disturbed (the machine is shared, a burst of other work lands on one bucket), so:
- each bucket's time is the median of repeated calls (the candidates in turns);
- a bucket that disagrees with its neighbours (less work costing ``SUSPECT_RATIO``x more than a bigger bucket,
  or a row costing that much more than at fewer rows) is measured again, up to ``RETRIES`` times;
- each entry records when it was measured and how busy other processes kept the CPUs meanwhile
  (``/proc/stat``); an entry measured busy, or one still disagreeing with its neighbours, is measured again at a
  later start that finds the machine quiet (``needs_refresh``).
``pagedllm bench kernels`` prints the table.

This module knows nothing about layers: ``model_executor/layers/quantization/kernel_choice.py`` says what
the candidates of a weight are and applies the choices.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pagedllm import envs
from pagedllm.config import AUTOTUNE_MODES
from pagedllm.logger import init_logger
from pagedllm.utils import cache_dir

logger = init_logger(__name__)

MODES = AUTOTUNE_MODES
#: Rows each bucket is timed at; a call with M rows runs the choice of the bucket whose range holds M:
#: 1-2 -> 1, 3-8 -> 4, 9-32 -> 16, 33-128 -> 64, 129+ -> 256.
BUCKET_ROWS = (1, 4, 16, 64, 256)
_UPPER_EDGES = (2, 8, 32, 128)  # largest M of each bucket but the last
TABLE_VERSION = 2  # 2: medians (1 kept each candidate's fastest call)
#: A bucket whose time disagrees with its neighbours by this factor is measured again.
SUSPECT_RATIO = 3.0
RETRIES = 2
#: Other processes keeping this share of the CPUs busy make a measurement "busy" (re-measured when quiet).
BUSY_LOAD = 0.25
#: A quiet machine re-measures an entry that still disagrees with its neighbours this many times at most.
MAX_REFRESHES = 2

Kernel = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def bucket_ranges() -> list[tuple[int, int | None]]:
    """(first, last) rows of each bucket of ``BUCKET_ROWS``; the last bucket's last is None (no end)."""
    return list(zip([1] + [edge + 1 for edge in _UPPER_EDGES], [*_UPPER_EDGES, None], strict=True))


def bucket_index(rows: int) -> int:
    """The bucket (index into ``BUCKET_ROWS``) of a matmul with ``rows`` rows."""
    return bisect.bisect_left(_UPPER_EDGES, rows)


def by_rows(kernels: list[Kernel]) -> Kernel:
    """One kernel per bucket -> one kernel that runs the bucket's choice; the kernel itself where all agree."""
    if all(k is kernels[0] for k in kernels):
        return kernels[0]
    edges = _UPPER_EDGES

    def run(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        return kernels[bisect.bisect_left(edges, x.shape[0])](x, bias, out)

    return run


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _cpu_flags() -> list[str]:
    wanted = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
              "amx_int8", "avx_vnni"}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(wanted & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def fingerprint(kernels_build: str) -> dict[str, Any]:
    """What a measured table holds for: the CPU, the threads the matmuls run on, the libraries."""
    return {"version": TABLE_VERSION, "cpu": _cpu_model(), "flags": _cpu_flags(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": kernels_build}


def time_once(kernel: Kernel, x: torch.Tensor) -> float:
    """Seconds of one call ``kernel(x, None, None)``."""
    start = time.perf_counter()
    kernel(x, None, None)
    return time.perf_counter() - start


def cpu_snapshot() -> tuple[float, float, float]:
    """(CPU seconds busy on the whole machine, CPU seconds elapsed on it, this process's CPU seconds), from
    ``/proc/stat`` and ``os.times``; zeros where /proc/stat cannot be read."""
    own = os.times()
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0, own.user + own.system
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is counted in user)
    return (total - idle) / ticks, total / ticks, own.user + own.system


# /proc/stat counts in clock ticks (10 ms): a window of a few ticks would read one stray tick as a busy machine.
MIN_LOAD_WINDOW_S = 0.2  # CPU seconds of the whole machine


def other_load(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """The share (0..1) of the machine's CPUs that other processes kept busy between two ``cpu_snapshot``s; 0 for
    a window too short to tell (under ``MIN_LOAD_WINDOW_S``)."""
    elapsed = after[1] - before[1]
    if elapsed < MIN_LOAD_WINDOW_S:
        return 0.0
    others = (after[0] - before[0]) - (after[2] - before[2])
    return min(1.0, max(0.0, others / elapsed))


def load_now(seconds: float = 0.25) -> float:
    """How busy other processes keep the CPUs now (``other_load`` over ``seconds``)."""
    before = cpu_snapshot()
    time.sleep(seconds)
    return other_load(before, cpu_snapshot())


def suspicious_buckets(ms: list[float], ratio: float = SUSPECT_RATIO) -> list[int]:
    """Buckets whose time (one candidate's, per bucket of ``BUCKET_ROWS``) disagrees with a neighbour: less work
    costing ``ratio``x more than the next bucket's, or a row costing ``ratio``x more than at the bucket before."""
    out = []
    for b, t in enumerate(ms):
        slower_than_more = b + 1 < len(ms) and t >= ratio * ms[b + 1] > 0
        row_costlier = b > 0 and t / BUCKET_ROWS[b] >= ratio * ms[b - 1] / BUCKET_ROWS[b - 1] > 0
        if slower_than_more or row_costlier:
            out.append(b)
    return out


class AutotuneTable:
    """shape key -> one candidate name per bucket, with the timings that chose them, for one fingerprint.

    ``path``: the JSON file (default ``<cache dir>/cpu_kernel_autotune.json``); ``read_only``: never written
    (a table given by ``PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE``, which forces its choices)."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], read_only: bool = False) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.read_only = read_only
        self.entries: dict[str, dict[str, Any]] = {}
        self.stale = False  # a table was there, measured elsewhere (ignored)

    @classmethod
    def open(cls, fingerprint: dict[str, Any]) -> AutotuneTable:
        forced = envs.PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE
        if forced:
            table = cls(Path(forced), fingerprint, read_only=True)
            table.entries = json.loads(Path(forced).read_text()).get("entries", {})
            return table
        table = cls(default_path(), fingerprint)
        table.load()
        return table

    def load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if data.get("fingerprint") != self.fingerprint:
            self.stale = True
            return
        self.entries = data.get("entries", {})

    def save(self) -> None:
        if self.read_only:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "entries": self.entries}, indent=1,
                                  sort_keys=True))
        tmp.replace(self.path)  # atomic: a reader sees the old table or the new one

    def choices(self, key: str) -> list[str] | None:
        entry = self.entries.get(key)
        return list(entry["choices"]) if entry is not None else None

    def record(self, key: str, choices: list[str], timings: dict[str, list[float]], load: float = 0.0) -> None:
        """``timings``: seconds per candidate per bucket; ``load``: the share of the CPUs other processes kept
        busy while they were measured. The chosen kernels' buckets that still disagree with their neighbours
        are kept as ``suspect``."""
        ms = {name: [round(t * 1e3, 4) for t in ts] for name, ts in timings.items()}
        chosen = [ms[name][b] for b, name in enumerate(choices) if name in ms and b < len(ms[name])]
        suspect = suspicious_buckets(chosen) if len(chosen) == len(choices) else []
        previous = self.entries.get(key, {})
        self.entries[key] = {"choices": choices, "ms": ms,
                             "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "load": round(load, 3), "busy": load >= BUSY_LOAD, "suspect": suspect,
                             "refreshes": previous.get("refreshes", -1) + 1 if previous else 0}

    def needs_refresh(self, key: str) -> bool:
        """Whether the entry should be measured again once the machine is quiet: measured busy, or its chosen
        kernels' times still disagree with their neighbours (at most ``MAX_REFRESHES`` times)."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        return bool(entry.get("busy")) or (bool(entry.get("suspect")) and
                                           entry.get("refreshes", 0) < MAX_REFRESHES)


def default_path() -> Path:
    return cache_dir() / "cpu_kernel_autotune.json"



@contextlib.contextmanager
def measuring_lock(table: AutotuneTable) -> Iterator[None]:
    """One process measures at a time (the engines of a data-parallel server start together, and timings taken
    side by side measure each other); the next one reloads the table the first saved."""
    if table.read_only:
        yield
        return
    table.path.parent.mkdir(parents=True, exist_ok=True)
    with open(table.path.with_suffix(".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            table.load()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _measure(candidates: dict[str, Kernel], x: torch.Tensor, timer: Callable[[Kernel, torch.Tensor], float],
             min_rounds: int, max_rounds: int, min_seconds: float, max_seconds: float) -> dict[str, float]:
    """The median seconds of each candidate on ``x``: after one warm-up call each, the candidates run in turns
    (A, B, A, B, ...): at least 2 rounds, ``min_rounds`` unless a candidate has spent ``max_seconds`` (a large
    head at 256 rows), more until one has spent ``min_seconds`` (at most ``max_rounds``)."""
    for kernel in candidates.values():
        kernel(x, None, None)
    calls: dict[str, list[float]] = {name: [] for name in candidates}
    spent = 0.0
    for done in range(1, max_rounds + 1):
        for name, kernel in candidates.items():
            took = timer(kernel, x)
            calls[name].append(took)
            spent += took
        per_candidate = spent / len(candidates)
        if done >= 2 and ((done >= min_rounds and per_candidate >= min_seconds) or per_candidate >= max_seconds):
            break
    return {name: statistics.median(ts) for name, ts in calls.items()}


def choose(candidates: dict[str, Kernel], in_features: int, timer: Callable[[Kernel, torch.Tensor], float]
           = time_once, min_rounds: int = 5, max_rounds: int = 50, min_seconds: float = 0.01,
           max_seconds: float = 0.5, margin: float = 0.05, dtype: torch.dtype = torch.float32,
           first_bucket: dict[str, int] | None = None) -> tuple[list[str], dict[str, list[float]]]:
    """Times every candidate at every bucket's rows; the fastest name per bucket, and the timings (seconds).

    Per bucket each candidate's time is the median of its calls (``_measure``): a burst of other work on a
    shared machine spoils a few calls, not the middle one. A bucket where a candidate's time disagrees with its
    neighbours (``suspicious_buckets``) is measured again (every candidate, so the comparison stays fair), up to
    ``RETRIES`` times. The first candidate (the packing's own kernel) stays unless another is faster by more than
    ``margin``: a second kernel can cost a second copy of the weight, so noise must not buy one.
    ``first_bucket``: name -> the first bucket it may be chosen for (timed everywhere, for the log)."""
    names = list(candidates)
    xs = [torch.randn(rows, in_features, dtype=dtype) for rows in BUCKET_ROWS]
    per_bucket = [_measure(candidates, x, timer, min_rounds, max_rounds, min_seconds, max_seconds) for x in xs]
    for _ in range(RETRIES):
        again = sorted({b for name in names for b in suspicious_buckets([m[name] for m in per_bucket])})
        if not again:
            break
        for b in again:
            per_bucket[b] = _measure(candidates, xs[b], timer, min_rounds, max_rounds, min_seconds, max_seconds)
    timings = {name: [m[name] for m in per_bucket] for name in names}
    choices = []
    first_bucket = first_bucket or {}
    for b in range(len(BUCKET_ROWS)):
        fastest = min((n for n in names if first_bucket.get(n, 0) <= b), key=lambda n: timings[n][b])
        keep = timings[names[0]][b] <= timings[fastest][b] * (1.0 + margin)
        choices.append(names[0] if keep else fastest)
    return choices, timings
