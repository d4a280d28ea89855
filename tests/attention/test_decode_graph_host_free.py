"""What a CUDA graph captures must not read tensor values on the host or build tensors from host data: a sync
breaks the capture, and a value read at capture time would be baked into every replay. Checked on the CPU by
running the decode-graph forward with the CUDA path's kernels (Triton attention and element-wise ops, under
the interpreter) while a dispatch mode watches every aten op for the ones that do either."""

from __future__ import annotations

import os

if os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.kernels import triton_ops
from pagedllm.model_executor.layers.attention import attention_layers, bind_kv_caches
from pagedllm.model_executor.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from pagedllm.worker.cuda_graphs import DecodeGraphRunner

from helpers.host_reads import HostReads
from helpers.model_helpers import cpu_tensors_get_cuda_elementwise_ops, make_kv_caches, tiny_llama_config

pytestmark = pytest.mark.skipif(not (triton_ops.triton_available() and triton_ops.interpreted()),
                                reason="runs CPU tensors through Triton's interpreter (triton is a test dependency)")


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize("arch,overrides", [
    (LlamaForCausalLM, {}),
    (Qwen3ForCausalLM, {}),  # per-head q/k norms
    (LlamaForCausalLM, {"sliding_window": 6}),
    (LlamaForCausalLM, {"rope_parameters": LONGROPE}),  # the long/short table pick reads device tensors only
])
def test_decode_graph_forward_reads_nothing_on_the_host(arch, overrides, monkeypatch) -> None:
    cpu_tensors_get_cuda_elementwise_ops(monkeypatch)
    from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend

    torch.manual_seed(0)
    cfg = tiny_llama_config(**overrides)
    model = arch(cfg, torch.float32).eval()
    for layer in attention_layers(model):
        layer.backend = TritonPagedAttentionBackend(TorchPagedAttentionBackend())
    block_size = 4
    bind_kv_caches(model, make_kv_caches(cfg, 8, block_size))
    runner = DecodeGraphRunner(model, torch.device("cpu"), [1, 2, 4], max_blocks_per_seq=5, block_size=block_size,
                               hidden_size=cfg.hidden_size, dtype=torch.float32)
    runner.seq_lens[:3] = torch.tensor([5, 2, 40], dtype=torch.int32)  # one past LongRoPE's original length
    runner.positions[:3] = runner.seq_lens[:3] - 1
    runner.block_tables[:3, :2] = torch.tensor([[1, 2], [3, 0], [4, 5]], dtype=torch.int32)
    with torch.inference_mode(), HostReads() as watch:
        hidden = runner._forward(4)
    assert watch.seen == []
    assert hidden.shape == (4, cfg.hidden_size) and torch.isfinite(hidden).all()
