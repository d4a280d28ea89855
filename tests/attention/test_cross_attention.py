"""Cross-attention over the cross-attention KV cache group: the C++ kernel path (each query token as a request of
its own) and the portable path equal plain unmasked attention over each request's encoder K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.backends.cross_attention import cross_attention
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.worker.encoder_decoder import EncoderDecoderRunner

from helpers.step_state import prepared

BLOCK, POSITIONS, HEADS, DIM = 16, 100, 4, 16


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])  # bf16: --kv-cache-dtype, float32 model
@pytest.mark.parametrize("use_kernels", [False, True])
def test_cross_attention_equals_unmasked_attention(use_kernels: bool, cache_dtype: torch.dtype) -> None:
    kernels = load_cpu_kernels() if use_kernels else None
    if use_kernels and kernels is None:
        pytest.skip("C++ CPU kernels unavailable")
    torch.manual_seed(0)
    num_blocks = 40
    cache = torch.zeros(2, num_blocks, BLOCK, HEADS, DIM, dtype=cache_dtype)
    runner = EncoderDecoderRunner(torch.nn.Identity(), 1, POSITIONS, BLOCK, torch.device("cpu"))
    tables = [[3, 9, 1, 12, 5, 7, 30], [20, 21, 2, 4, 6, 8, 10], [11, 13, 14, 15, 16, 17, 18]]  # 7 blocks = 112
    encoder_kv = []
    for table in tables:  # each request's encoder K/V written at its slots, as write_cross_kv does
        # As the cache keeps them: the reference attends to what every path reads back.
        k, v = (torch.randn(POSITIONS, HEADS, DIM).to(cache_dtype).float() for _ in range(2))
        slots = torch.from_numpy(runner.slot_mapping(table))
        cache[0].view(-1, HEADS, DIM)[slots] = k.to(cache_dtype)
        cache[1].view(-1, HEADS, DIM)[slots] = v.to(cache_dtype)
        encoder_kv.append((k, v))
    query_lens = [1, 1, 5]  # two decodes, one prompt of 5 tokens
    decoder = build_attention_metadata(query_lens, [7, 3, 5], [[0], [0], [0]], BLOCK)
    meta = prepared(runner.cross_metadata(tables, decoder), AttentionSpec.cross(), kernels=kernels)
    query = torch.randn(sum(query_lens), HEADS, DIM)
    out = cross_attention(query, cache, meta, DIM ** -0.5, kernels)
    start = 0
    for (k, v), q_len in zip(encoder_kv, query_lens):
        q = query[start:start + q_len].transpose(0, 1)
        expected = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale=DIM ** -0.5)
        torch.testing.assert_close(out[start:start + q_len], expected.transpose(0, 1), atol=1e-5, rtol=1e-5)
        start += q_len


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_layer_write_kv_stores_strided_rows_like_the_portable_store(cache_dtype: torch.dtype) -> None:
    """``Attention.write_kv`` (cross-attention K/V from the encoder, slices of one fused projection) through the CPU
    backend's C++ store equals the portable index_copy store, float32 K/V into either cache dtype."""
    from pagedllm.attention.backends.cpu_paged import CpuPagedAttentionBackend
    from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
    from pagedllm.attention.spec import AttentionSpec
    from pagedllm.model_executor.layers.attention import Attention

    if load_cpu_kernels() is None:
        pytest.skip("C++ CPU kernels unavailable")
    torch.manual_seed(0)
    kv = torch.randn(POSITIONS, 2 * HEADS * DIM)  # [N, k | v]
    slots = torch.randperm(40 * BLOCK)[:POSITIONS]
    caches = []
    for backend in (CpuPagedAttentionBackend(), TorchPagedAttentionBackend()):
        layer = Attention(HEADS, DIM, DIM ** -0.5, layer_idx=0, spec=AttentionSpec.cross(), backend=backend)
        layer.kv_cache = torch.zeros(2, 40, BLOCK, HEADS, DIM, dtype=cache_dtype)
        layer.write_kv(kv[:, :HEADS * DIM], kv[:, HEADS * DIM:], slots)
        caches.append(layer.kv_cache)
    assert torch.equal(caches[0], caches[1])
    flat = caches[0].view(2, -1, HEADS, DIM)
    assert torch.equal(flat[1, slots].float(), kv[:, HEADS * DIM:].view(-1, HEADS, DIM).to(cache_dtype).float())
