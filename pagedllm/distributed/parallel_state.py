"""The tensor-parallel group of this process: its rank, the world size, and the collectives the parallel layers
call (all-reduce of a row-parallel output, all-gather of vocab-sharded logits, the embedding's all-reduce).

One group per process, set once by the worker before it builds the model (``init_tensor_parallel``), read by
the layers while they are built (``get_tp``); a process that never calls it is rank 0 of 1 and every collective
is the identity. The torch.distributed backend comes from the platform (gloo on a CPU, NCCL on CUDA).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pagedllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    backend: str = "none"
    # MoE layers place whole experts on ranks instead of splitting each expert (--enable-expert-parallel).
    expert_parallel: bool = False

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


_TP = TensorParallelGroup()
# Per-call cost of the collectives (read by the benchmark in docs/distributed.md): calls and seconds.
COLLECTIVE_STATS = {"all_reduce_calls": 0, "all_reduce_s": 0.0, "all_gather_calls": 0, "all_gather_s": 0.0}
_timed = False
# How long a rank may take to start (join the group, then size its KV cache): a loaded host or a first kernel
# build can take a minute; one that exits is seen at once.
RANK_STARTUP_TIMEOUT_S = 900.0
# How long a collective waits for a peer before it fails (a rank that died is usually seen at once: its sockets
# close; this bounds the case where it hangs instead).
COLLECTIVE_TIMEOUT_S = 60.0


def get_tp() -> TensorParallelGroup:
    return _TP


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         join_timeout_s: float = RANK_STARTUP_TIMEOUT_S,
                         collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                         alive: Callable[[], None] | None = None,
                         expert_parallel: bool = False) -> TensorParallelGroup:
    """Join the group (blocks until every rank has joined). ``init_method``: ``tcp://host:port`` of rank 0.

    Rank 0 hosts the rendezvous store and waits up to ``join_timeout_s`` for every other rank to check in,
    calling ``alive()`` (which raises when a rank already exited) between polls: a rank slow to start (a
    loaded host, a first kernel build) is waited for, a dead one fails the start at once. Only then is the
    process group formed, so its own ``collective_timeout_s`` bounds the collectives, not the start-up.
    ``expert_parallel``: MoE layers hold whole experts per rank (``layers/fused_moe``).
    """
    global _TP
    if world_size > 1:
        host, port = _host_port(init_method)
        join_timeout = datetime.timedelta(seconds=join_timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=join_timeout,
                              wait_for_workers=False)
        if rank == 0:
            _wait_for_ranks(store, world_size, join_timeout_s, alive)
        else:
            store.set(_joined_key(rank), "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        logger.info("tensor parallel rank %d of %d joined (%s)", rank, world_size, backend)
    _TP = TensorParallelGroup(rank, world_size, backend, expert_parallel)
    return _TP


def _host_port(init_method: str) -> tuple[str, int]:
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise ValueError(f"tensor parallel init_method: expected tcp://host:port, got {init_method!r}")
    return parsed.hostname, parsed.port


def _joined_key(rank: int) -> str:
    return f"pagedllm/joined/{rank}"


def _wait_for_ranks(store: dist.TCPStore, world_size: int, timeout_s: float,
                    alive: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if alive is not None:
            alive()
        pending = [r for r in range(1, world_size) if not store.check([_joined_key(r)])]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel ranks {pending} did not join the group within {timeout_s:.0f} s")
        time.sleep(0.05)


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.is_parallel and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelGroup()


def time_collectives(enabled: bool) -> None:
    """Count and time every collective from now on (off by default: a timer per call is not free)."""
    global _timed
    _timed = enabled


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``."""
    if _TP.world_size == 1:
        return x
    if not _timed:
        dist.all_reduce(x)
        return x
    t0 = time.perf_counter()
    dist.all_reduce(x)
    COLLECTIVE_STATS["all_reduce_calls"] += 1
    COLLECTIVE_STATS["all_reduce_s"] += time.perf_counter() - t0
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] on each rank -> [..., world_size * n], rank r's slice at r * n."""
    if _TP.world_size == 1:
        return x
    t0 = time.perf_counter() if _timed else 0.0
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous())
    out = torch.cat(parts, dim=-1)
    if _timed:
        COLLECTIVE_STATS["all_gather_calls"] += 1
        COLLECTIVE_STATS["all_gather_s"] += time.perf_counter() - t0
    return out


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming ``what`` and both numbers."""
    if numerator % denominator:
        raise ValueError(f"tensor_parallel_size {denominator} does not divide {what} ({numerator})")
    return numerator // denominator
