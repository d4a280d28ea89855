"""The Triton paged-attention kernel (the CUDA backend) against a dense reference, run by Triton's
interpreter on the CPU (``TRITON_INTERPRET=1``), so CI checks the kernel without a GPU.

On a GPU machine: ``PAGEDLLM_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/attention`` compiles and runs
the same cases on the GPU (``benchmarks/gpu_check.sh`` does)."""

from __future__ import annotations

import os
import random

import pytest
import torch

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels on the CPU

from pagedllm.attention.backends.triton_paged import tile_shape, triton_paged_attention  # noqa: E402
from pagedllm.attention.metadata import build_attention_metadata  # noqa: E402
from pagedllm.kernels.triton_ops import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is a test dependency; install .[test]")


def _reference(query, key, value, query_lens, context_lens, scale, window):
    """Dense attention per request over [its context | its new tokens], causal (+ window)."""
    out = torch.empty_like(query)
    start = 0
    for q_len, (ctx_k, ctx_v) in zip(query_lens, context_lens):
        k = torch.cat([ctx_k, key[start:start + q_len]])  # [L, Hkv, D]
        v = torch.cat([ctx_v, value[start:start + q_len]])
        seq_len = k.shape[0]
        group = query.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[start:start + q_len]
        scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(query.dtype)
        start += q_len
    return out


def _run(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, window=0, seed=0,
         dtype=torch.float32, num_splits=None):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)  # out-of-order, non-contiguous physical blocks
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(ids[:n])
        ids = ids[n:]
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    contexts = []
    for c, table in zip(context_lens, tables):
        ck = torch.randn(c, num_kv_heads, head_dim, dtype=dtype)
        cv = torch.randn(c, num_kv_heads, head_dim, dtype=dtype)
        for pos in range(c):
            cache[0, table[pos // block_size], pos % block_size] = ck[pos]
            cache[1, table[pos // block_size], pos % block_size] = cv[pos]
        contexts.append((ck, cv))
    t = sum(query_lens)
    # query as a strided view of a fused qkv buffer, as the models hand it over
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    query = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    key = torch.randn(t, num_kv_heads, head_dim, dtype=dtype)
    value = torch.randn(t, num_kv_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected = _reference(query, key, value, query_lens, contexts, scale, window)
    on = {"device": DEVICE}
    qkv, key, value, cache = qkv.to(**on), key.to(**on), value.to(**on), cache.to(**on)
    query = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    got = triton_paged_attention(query, key, value, cache, meta, scale, sliding_window=window,
                                 num_splits=num_splits).cpu()
    return got, expected, cache.cpu(), meta, key.cpu()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 8), (6, 3, 12), (8, 1, 16)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_mixed_step_matches_reference(num_heads, num_kv_heads, head_dim, block_size) -> None:
    # decodes first, then a chunk with context, then a fresh prompt (as the scheduler orders them)
    query_lens = [1, 1, 1, 7, 23]
    context_lens = [0, 13, 40, 21, 0]
    got, expected, *_ = _run(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_new_kv_written_by_slot() -> None:
    got, expected, cache, meta, key = _run([1, 5], [9, 3], 4, 2, 16, 16)
    flat_k = cache[0].view(-1, 2, 16)
    torch.testing.assert_close(flat_k[meta.slot_mapping.cpu()], key)


@pytest.mark.parametrize("window", [1, 4, 19])
def test_sliding_window(window: int) -> None:
    got, expected, *_ = _run([1, 6, 30], [50, 17, 0], 6, 2, 16, 8, window=window, seed=window)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_bf16_cache_and_query() -> None:
    got, expected, *_ = _run([1, 3, 9], [20, 11, 0], 9, 3, 64, 16, dtype=torch.bfloat16, seed=2)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("group,max_query_len", [(1, 1), (3, 1), (3, 200), (16, 1), (32, 1), (7, 9)])
def test_tile_shape_covers_group(group: int, max_query_len: int) -> None:
    block_m, block_q = tile_shape(group, max_query_len)
    assert block_m & (block_m - 1) == 0 and block_m >= 16  # a power of two, at least one tl.dot tile
    assert block_q >= 1 and block_q * group <= block_m


def test_backend_routes_encoder_layers_to_the_fallback() -> None:
    from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend
    from pagedllm.attention.spec import AttentionSpec

    class Recorder:
        calls = 0

        def forward(self, *args):
            Recorder.calls += 1
            return args[0]

    backend = TritonPagedAttentionBackend(Recorder())
    q = torch.randn(3, 2, 16)
    meta = build_attention_metadata([3], [3], [[1]], 16)
    assert backend.forward(q, q, q, None, meta, AttentionSpec.encoder(), 0.25) is q and Recorder.calls == 1
    cache = torch.zeros(2, 2, 16, 2, 16)
    out = backend.forward(q, q.clone(), q.clone(), cache, meta, AttentionSpec.sliding(2), 0.25)
    assert out.shape == q.shape and Recorder.calls == 1  # causal/sliding layers stay on the kernel


def test_cpu_processes_do_not_import_triton() -> None:
    import subprocess
    import sys

    code = ("import sys, torch; from pagedllm.model_executor.layers.attention import Attention; "
            "from pagedllm.model_executor.layers.layernorm import RMSNorm; "
            "RMSNorm(8)(torch.randn(2, 8)); print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PAGEDLLM_CPU_KERNELS": "0"})
    assert out.stdout.strip() == "False"


def test_layer_with_rotary_writing_kv_equals_the_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotary attention layer on the Triton backend takes the fused path (rotary writes K/V, the kernel
    attends with key = value = None) and matches the same layer on the torch backend, cache included, over a
    prefill step and a mixed step that reads it back."""
    from pagedllm.attention.backends import triton_paged
    from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
    from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend
    from pagedllm.model_executor.layers.attention import attention_step, step_readers
    from pagedllm.model_executor.layers.rotary_embedding import RopeStep, RotaryEmbedding
    from pagedllm.model_executor.models.blocks import RotaryAttention

    def unfused(*args):
        raise AssertionError("the Triton backend wrote K/V itself: the fused path was not taken")

    monkeypatch.setattr(triton_paged, "write_kv", unfused)
    layers, caches = [], []
    for backend in (TorchPagedAttentionBackend(), TritonPagedAttentionBackend(TorchPagedAttentionBackend())):
        torch.manual_seed(0)
        layer = RotaryAttention(48, 4, 2, 16, layer_idx=0, dtype=torch.float32)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.2)
        layer.to(DEVICE)
        layer.attn.backend = backend
        layer.attn.kv_cache = torch.zeros(2, 8, 4, 2, 16, device=DEVICE)
        layers.append(layer)
        caches.append(layer.attn.kv_cache)
    assert layers[1].attn.backend.takes_kv_from_rotary(torch.zeros(1)) and not layers[0].attn.write_kv_with_rotary(
        torch.zeros(1, 128), None)
    emb = RotaryEmbedding(16, 64, 10000.0, {}, torch.float32)
    tables = [[3, 5], [1, 6, 2]]
    for query_lens, seq_lens in (([5, 7], [5, 7]), ([1, 4], [6, 11])):  # prefill, then a decode + a chunk
        meta = build_attention_metadata(query_lens, seq_lens, tables, 4, DEVICE)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(DEVICE)
        x = torch.randn(sum(query_lens), 48).to(DEVICE)
        outs = []
        for layer in layers:
            with attention_step(meta, step_readers(layer)):
                outs.append(layer(x, RopeStep(emb, positions)))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[1], caches[0], atol=1e-6, rtol=1e-6)
    assert caches[1].abs().sum() > 0


@pytest.mark.parametrize("num_splits", [2, 4, 16])
@pytest.mark.parametrize("window", [0, 21])
def test_decode_split_over_the_context(num_splits: int, window: int) -> None:
    """Flash-decoding: a decode-only step whose contexts are split into shares (some empty: short contexts,
    windows) and combined matches the dense reference."""
    from pagedllm.attention.backends import triton_paged

    got, expected, *_ = _run([1, 1, 1], [70, 3, 130], 6, 2, 16, 8, window=window, seed=num_splits,
                             num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert triton_paged.decode_splits(3 * 2, 17, 64) == 2  # capped by the shortest useful share (8 blocks)


def test_decode_split_count() -> None:
    from pagedllm.attention.backends.triton_paged import decode_splits

    assert decode_splits(3, 512, 132) == 32  # batch 1, long context: as many shares as allowed
    assert decode_splits(3, 12, 132) == 1  # short contexts: no split
    assert decode_splits(512 * 3, 512, 132) == 1  # the batch fills the GPU already
    assert decode_splits(24, 64, 132) == 8  # 11 wanted, 8 blocks per share at least, powers of two


@pytest.mark.parametrize("window", [0, 6])
def test_stale_non_finite_cache_slots_are_never_read(window: int) -> None:
    """Slots past a request's last token and before its window hold other requests' data, maybe NaN/Inf (an
    overflowed fp16 request): masked scores alone would still give 0 * NaN = NaN in the p @ V dot."""
    query_lens, context_lens, heads, kv_heads, dim, bs = [1, 1, 9], [10, 29, 5], 4, 2, 16, 8
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    tables = [[1, 2], [3, 4, 5, 6], [7, 8]]
    meta = build_attention_metadata(query_lens, seq_lens, tables, bs, DEVICE)
    cache = torch.full((2, 9, bs, kv_heads, dim), float("nan"))
    for table, context_len in zip(tables, context_lens):
        first_needed = max(0, context_len - window + 1) if window else 0  # the request's first query sees it
        for pos in range(first_needed, context_len):  # this step's own tokens are written by the call
            cache[:, table[pos // bs], pos % bs] = torch.randn(2, kv_heads, dim)
    t = sum(query_lens)
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    out = triton_paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE), meta, dim ** -0.5,
                                 sliding_window=window, num_splits=None)
    assert torch.isfinite(out.cpu()).all()


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,num_splits", [([1, 1, 1, 7, 23], None), ([1, 1, 1], 4)])
def test_fp8_cache_read_in_place_as_the_portable_path_reads_it(cache_dtype, query_dtype, query_lens,
                                                                num_splits) -> None:
    """--kv-cache-dtype fp8: the kernel loads the 8-bit rows, widens them in registers and applies the layer's
    k/v scales (the k scale with the scores', the v scale on the output; split decodes too). Against the portable
    torch path over a copy of the same cache: both store the step's K/V as the same bytes."""
    from pagedllm.attention.backends.paged_kv import quantize_kv
    from pagedllm.attention.backends.torch_sdpa import paged_attention as portable

    from helpers.step_state import prepared

    rng = random.Random(5)
    torch.manual_seed(5)
    block_size, num_heads, num_kv_heads, head_dim = 16, 6, 2, 32
    context_lens = [13, 40, 70, 21, 0][:len(query_lens)]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(ids[:n])
        ids = ids[n:]
    kv_scale = torch.tensor([0.02, 0.05])
    context = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3
    cache = torch.stack([quantize_kv(context[c], cache_dtype, kv_scale[c]) for c in (0, 1)])
    t = sum(query_lens)
    query = torch.randn(t, num_heads, head_dim).to(query_dtype)
    key = (torch.randn(t, num_kv_heads, head_dim) * 3).to(query_dtype)
    value = (torch.randn(t, num_kv_heads, head_dim) * 3).to(query_dtype)
    scale = head_dim ** -0.5
    want_cache = cache.clone()
    # float32 reference (a bf16 query's K/V widen exactly, and store the same bytes)
    want = portable(query.float(), key.float(), value.float(), want_cache,
                    prepared(build_attention_metadata(query_lens, seq_lens, tables, block_size)), scale, kv_scale)
    on = {"device": DEVICE}
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    got_cache = cache.to(**on)
    got = triton_paged_attention(query.to(**on), key.to(**on), value.to(**on), got_cache, meta, scale,
                                 num_splits=num_splits, kv_scale=kv_scale.to(**on)).cpu()
    assert torch.equal(got_cache.cpu().view(torch.uint8), want_cache.view(torch.uint8))
    tol = 2e-5 if query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
