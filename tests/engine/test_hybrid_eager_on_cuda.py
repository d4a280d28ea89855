"""A hybrid model (two KV cache groups) runs eagerly on CUDA: the captured decode graphs hold one block
table. Checked without a GPU by calling the worker's capture step on a stand-in worker."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from pagedllm.config import CacheConfig, DeviceConfig
from pagedllm.platforms import platform_for
from pagedllm.worker.worker import Worker


def test_hybrid_model_skips_cuda_graphs(caplog) -> None:
    cache = CacheConfig(num_blocks=64, sliding_group_window=512, sliding_group_num_blocks=32)
    stub = SimpleNamespace(device=torch.device("cuda"), platform=platform_for("cuda"),
                           config=SimpleNamespace(cache=cache, device=DeviceConfig()),
                           runner=SimpleNamespace(decode_graphs=None))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        Worker.capture_decode_graphs(stub)
    assert stub.runner.decode_graphs is None
    assert "run eagerly" in caplog.text


def test_pooling_model_captures_no_decode_graphs() -> None:
    stub = SimpleNamespace(device=torch.device("cuda"), platform=platform_for("cuda"),
                           config=SimpleNamespace(cache=CacheConfig(num_blocks=64), device=DeviceConfig()),
                           runner=SimpleNamespace(decode_graphs=None, pooling=object()))
    Worker.capture_decode_graphs(stub)  # would import triton and capture on a GPU otherwise
    assert stub.runner.decode_graphs is None
