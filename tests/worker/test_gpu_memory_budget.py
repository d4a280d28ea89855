"""KV cache sizing under --gpu-memory-utilization: the arithmetic, checked without a GPU."""

from __future__ import annotations

import pytest

from pagedllm.engine_args import EngineArgs
from pagedllm.worker.gpu_memory import gpu_kv_cache_budget

GiB = 1024**3


def test_budget_is_what_utilization_leaves() -> None:
    # 80 GiB card at 0.9 = 72 GiB; 2 GiB used (weights + context), 3 GiB step peak, 0.5 GiB reserve.
    assert gpu_kv_cache_budget(80 * GiB, 2 * GiB, 3 * GiB, 0.9, reserve=GiB // 2) == int(72 * GiB - 5.5 * GiB)


def test_memory_used_by_others_counts_against_the_share() -> None:
    alone = gpu_kv_cache_budget(80 * GiB, 2 * GiB, GiB, 0.5)
    shared = gpu_kv_cache_budget(80 * GiB, 12 * GiB, GiB, 0.5)
    assert alone - shared == 10 * GiB


def test_nothing_left_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        gpu_kv_cache_budget(16 * GiB, 14 * GiB, GiB, 0.9)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_utilization_out_of_range_is_rejected(value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=value).create_engine_config()


def test_flags_reach_the_config() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--gpu-memory-utilization", "0.5", "--enforce-eager"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.cache.gpu_memory_utilization == 0.5 and config.device.enforce_eager
    assert config.cache.kv_cache_memory is None  # device default, decided by the worker
