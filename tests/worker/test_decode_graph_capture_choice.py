"""Which engines capture decode graphs on CUDA: a hybrid model (two KV cache groups) does, with a buffer per
group; a pooling model and an attention backend that reads tensors on the host do not. Checked without a GPU
by calling the worker's capture step on a stand-in worker, with the capture itself recorded instead of run."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from pagedllm.config import CacheConfig, DeviceConfig, SchedulerConfig
from pagedllm.platforms import platform_for
from pagedllm.worker import cuda_graphs
from pagedllm.worker.worker import Worker


def stub_worker(cache: CacheConfig, backend: object, pooling: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        device=torch.device("cuda"), platform=platform_for("cuda"), attention_backend=backend, dtype=torch.float32,
        config=SimpleNamespace(cache=cache, device=DeviceConfig(), scheduler=SchedulerConfig(max_num_seqs=4),
                               model=SimpleNamespace(hf_config=SimpleNamespace(hidden_size=8))),
        runner=SimpleNamespace(decode_graphs=None, pooling=pooling, encoder_decoder=None, model=torch.nn.Module()))


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[cuda_graphs.DecodeGraphRunner]:
    runners: list[cuda_graphs.DecodeGraphRunner] = []
    monkeypatch.setattr(cuda_graphs.DecodeGraphRunner, "__init__", lambda self, *a, **kw: (
        setattr(self, "kwargs", kw), runners.append(self))[0])
    monkeypatch.setattr(cuda_graphs.DecodeGraphRunner, "capture", lambda self: None)
    return runners


GRAPH_SAFE = SimpleNamespace(name="triton", graph_safe=True)


def test_hybrid_model_captures_with_a_buffer_per_group(captured) -> None:
    cache = CacheConfig(num_blocks=64, sliding_group_window=512, sliding_group_num_blocks=32)
    stub = stub_worker(cache, GRAPH_SAFE)
    Worker.capture_decode_graphs(stub)
    assert stub.runner.decode_graphs is captured[0] and captured[0].kwargs["num_kv_groups"] == 2
    stub = stub_worker(CacheConfig(num_blocks=64), GRAPH_SAFE)
    Worker.capture_decode_graphs(stub)
    assert captured[1].kwargs["num_kv_groups"] == 1


def test_pooling_model_captures_no_decode_graphs(captured) -> None:
    stub = stub_worker(CacheConfig(num_blocks=64), GRAPH_SAFE, pooling=object())
    Worker.capture_decode_graphs(stub)  # would import triton and capture on a GPU otherwise
    assert stub.runner.decode_graphs is None and not captured


def test_a_backend_that_reads_the_host_runs_eagerly(captured, caplog) -> None:
    stub = stub_worker(CacheConfig(num_blocks=64), SimpleNamespace(name="torch", graph_safe=False))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        Worker.capture_decode_graphs(stub)
    assert stub.runner.decode_graphs is None and not captured
    assert "'torch' reads tensors on the host" in caplog.text
