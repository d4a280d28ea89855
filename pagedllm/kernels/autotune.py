"""The CPU kernel autotuner's table: which candidate kernel each matmul shape runs, per number of rows.

A kernel tuned on one CPU can lose on the next (one 4-bit decode kernel beat llama.cpp on one CPU and lost to it
on another: docs/performance.md), and the fastest kernel for one decode stream (M = 1, bound by weight
bytes) is not the fastest for a 200-request batch (compute-bound). So the choice is measured on the machine at
hand: for every shape class (a format, N, K, group) and every bucket of rows, each candidate is timed on
random inputs and the fastest kept. The table is saved per machine fingerprint (CPU model and flags, threads,
torch version, the kernels' build name), so later starts skip the timing; a table from another fingerprint is
ignored and measured again.

This module knows nothing about layers: ``model_executor/layers/quantization/kernel_choice.py`` says what
the candidates of a weight are and applies the choices.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import json
import os
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
TABLE_VERSION = 1

Kernel = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


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

    def record(self, key: str, choices: list[str], timings: dict[str, list[float]]) -> None:
        self.entries[key] = {"choices": choices, "ms": {name: [round(t * 1e3, 4) for t in ts]
                                                         for name, ts in timings.items()}}


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


def choose(candidates: dict[str, Kernel], in_features: int, timer: Callable[[Kernel, torch.Tensor], float]
           = time_once, min_rounds: int = 5, max_rounds: int = 50, min_seconds: float = 0.01,
           max_seconds: float = 0.5, margin: float = 0.05, dtype: torch.dtype = torch.float32
           ) -> tuple[list[str], dict[str, list[float]]]:
    """Times every candidate at every bucket's rows; the fastest name per bucket, and the timings (seconds).

    Per bucket, after one warm-up call each, the candidates run in turns (A, B, A, B, ...): at least 2 rounds,
    ``min_rounds`` unless a candidate has spent ``max_seconds`` (a large head at 256 rows), more until one has
    spent ``min_seconds`` (at most ``max_rounds``). Each keeps its fastest call: on a shared machine a burst of
    other work slows both sides of a comparison, and the minimum is the run nothing interrupted. The first
    candidate (the packing's own kernel) stays unless another is faster by more than ``margin``: a second
    kernel can cost a second copy of the weight, so noise must not buy one."""
    timings: dict[str, list[float]] = {name: [] for name in candidates}
    for rows in BUCKET_ROWS:
        x = torch.randn(rows, in_features, dtype=dtype)
        for kernel in candidates.values():
            kernel(x, None, None)
        best = dict.fromkeys(candidates, float("inf"))
        spent = 0.0
        for done in range(1, max_rounds + 1):
            for name, kernel in candidates.items():
                took = timer(kernel, x)
                best[name] = min(best[name], took)
                spent += took
            per_candidate = spent / len(candidates)
            if done >= 2 and ((done >= min_rounds and per_candidate >= min_seconds) or per_candidate >= max_seconds):
                break
        for name in candidates:
            timings[name].append(best[name])
    names = list(candidates)
    choices = []
    for b in range(len(BUCKET_ROWS)):
        fastest = min(names, key=lambda n: timings[n][b])
        keep = timings[names[0]][b] <= timings[fastest][b] * (1.0 + margin)
        choices.append(names[0] if keep else fastest)
    return choices, timings
