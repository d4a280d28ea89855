"""fp8 KV cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2): the store (torch and C++) and the attention that reads
the bytes in place (the C++ paged kernel, and the CPU backend's routing of a mixed step) against float32 references."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backends import cpu_paged
from pagedllm.attention.backends.paged_kv import as_stored, gather_tokens, quantize_kv, write_kv
from pagedllm.attention.backends.torch_sdpa import _attend_with_context
from pagedllm.attention.backends.torch_sdpa import paged_attention as portable_paged_attention
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.kernels.cpu import load_cpu_kernels

from helpers.step_state import prepared

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Relative rounding of a normal value (half an ulp): 3 mantissa bits for e4m3, 2 for e5m2.
REL_ROUNDING = {torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}


def _kernels():
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C++ CPU kernel must build on the test machine"
    return kernels


def _tables(seq_lens: list[int], block_size: int, rng: random.Random, num_ids: int) -> list[list[int]]:
    ids = list(range(1, num_ids))
    rng.shuffle(ids)
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(ids[:n])
        ids = ids[n:]
    return tables


@pytest.mark.parametrize("cache_dtype", FP8)
def test_torch_store_rounds_saturates_and_reads_back_with_the_scale(cache_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=cache_dtype)
    key, value = torch.randn(5, 2, 8) * 3, torch.randn(5, 2, 8) * 3
    key[0, 0, 0] = 1e9  # past any range: stored as the largest finite value, never NaN / inf
    kv_scale = torch.tensor([0.05, 0.02])
    slots = torch.tensor([1, 2, 7, 8, 13])
    write_kv(cache, key, value, slots, kv_scale)
    table = torch.tensor([[0, 1, 2, 3]])
    k = gather_tokens(cache[0], table, 16, torch.float32, kv_scale[0])[0].transpose(0, 1).reshape(16, 2, 8)[slots]
    v = gather_tokens(cache[1], table, 16, torch.float32, kv_scale[1])[0].transpose(0, 1).reshape(16, 2, 8)[slots]
    big = torch.finfo(cache_dtype).max
    assert k[0, 0, 0] == big * 0.05 and torch.isfinite(k).all()
    rel = REL_ROUNDING[cache_dtype]
    mask = torch.ones_like(key, dtype=torch.bool)
    mask[0, 0, 0] = False
    assert ((k - key).abs() <= key.abs() * rel + 0.05 * 2.0 ** -9 + 1e-7)[mask].all()
    assert ((v - value).abs() <= value.abs() * rel + 0.02 * 2.0 ** -9 + 1e-7).all()
    # as_stored: a fresh prompt's own K/V rounded as the cache keeps them
    torch.testing.assert_close(as_stored(value, cache_dtype, kv_scale[1]), v, atol=0, rtol=0)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_kernel_store_writes_the_bytes_torch_writes(cache_dtype: torch.dtype, src_dtype: torch.dtype) -> None:
    """The C++ write_kv quantizes exactly as torch's cast does (value / scale, saturated, nearest even), from
    strided rows (slices of a fused qkv output)."""
    kernels = _kernels()
    torch.manual_seed(1)
    qkv = (torch.randn(29, 3 * 96) * 40).to(src_dtype)
    qkv[3, 100] = 1e30 if src_dtype == torch.float32 else 1e30  # saturates
    qkv[4, 200] = 1e-6  # an fp8 subnormal after the scale
    key, value = qkv[:, 96:192].view(29, 3, 32), qkv[:, 192:].view(29, 3, 32)
    kv_scale = torch.tensor([0.5, 0.125])
    slots = torch.randperm(64)[:29]
    ours = torch.zeros(2, 8, 8, 3, 32, dtype=cache_dtype)
    kernels.write_kv(key, value, ours[0], ours[1], slots, kv_scale)
    theirs = torch.zeros_like(ours)
    write_kv(theirs, key, value, slots, kv_scale)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def _fp8_batch(cache_dtype: torch.dtype, query_lens: list[int], seq_lens: list[int], block_size: int,
               num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    """(prepared metadata, float32 K/V of the whole cache, its fp8 copy, scales, query [T, H, D])."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    meta = prepared(build_attention_metadata(query_lens, seq_lens, _tables(seq_lens, block_size, rng, num_blocks),
                                             block_size))
    exact = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 4
    kv_scale = torch.tensor([0.03, 0.05])
    fp8 = torch.stack([quantize_kv(exact[c], cache_dtype, kv_scale[c]) for c in (0, 1)])
    return meta, exact, fp8, kv_scale, torch.randn(sum(query_lens), num_heads, head_dim)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2's heads: vector paths
    (8, 2, 32, 5),    # blocks of 5: pieces end inside a block
    (4, 2, 48, 64),   # three 16-column chunks per V sweep (AVX-512)
    (6, 3, 12, 16),   # D % 8 != 0: the scalar path
])
def test_kernel_reads_fp8_in_place_as_the_reference_reads_it(cache_dtype, query_dtype, num_heads, num_kv_heads,
                                                             head_dim, block_size) -> None:
    """Decodes and chunks with context, some past the kernel's 256-key partitions, against attention over the same
    cache dequantized to float32 (the same numbers up to summation order), and against attention over the float32
    K/V never rounded (within fp8's rounding)."""
    kernels = _kernels()
    query_lens = [1, 1, 1, 7, 3]
    seq_lens = [40, 300, 9, 77, 600]
    meta, exact, fp8, kv_scale, query = _fp8_batch(cache_dtype, query_lens, seq_lens, block_size, num_heads,
                                                   num_kv_heads, head_dim, seed=head_dim)
    query = query.to(query_dtype)
    scale = head_dim ** -0.5
    got = torch.zeros_like(query)
    rows = torch.arange(len(query_lens), dtype=torch.int32)
    kernels.paged_attention(query, fp8[0], fp8[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, got, scale,
                            rows, kv_scale=kv_scale)
    dequantized = torch.stack([fp8[c].float() * kv_scale[c] for c in (0, 1)])
    same_bytes = torch.zeros_like(query, dtype=torch.float32)
    _attend_with_context(query.float(), dequantized, meta, list(range(meta.num_reqs)), scale, same_bytes)
    tol = 2e-5 if query_dtype == torch.float32 else 1e-2  # a bf16 output rounds once
    torch.testing.assert_close(got.float(), same_bytes, atol=tol, rtol=tol)
    unrounded = torch.zeros_like(same_bytes)
    _attend_with_context(query.float(), exact, meta, list(range(meta.num_reqs)), scale, unrounded)
    # V's rounding moves an output by at most REL of the largest |V| it averages; K's shifts the weights a little.
    bound = 3 * REL_ROUNDING[cache_dtype] * exact[1].abs().max()
    assert (got.float() - unrounded).abs().max() < bound


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_step_matches_the_portable_path(cache_dtype, query_dtype, monkeypatch) -> None:
    """A whole mixed step through the CPU backend (the kernel's decodes and short prompts, a long fresh prompt and a
    long chunk routed elsewhere) against the portable torch path over the same fp8 cache in float32 (a bf16 query's
    K/V widen exactly): both write the same bytes and read them with the same scales."""
    monkeypatch.setattr(cpu_paged, "CONTEXT_CHUNK_KERNEL_MAX_LEN", 8)
    monkeypatch.setattr(cpu_paged, "BF16_CONTEXT_CHUNK_KERNEL_MAX_LEN", 8)
    kernels = _kernels()
    block_size, hkv, d = 16, 2, 64
    query_lens = [1, 1, 5, 40, 300, 20]
    seq_lens = [50, 17, 5, 90, 300, 20]  # decodes, a short fresh prompt, a long chunk, long fresh prompts
    rng = random.Random(3)
    torch.manual_seed(3)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    tables = _tables(seq_lens, block_size, rng, num_blocks)
    tokens = sum(query_lens)
    query = torch.randn(tokens, 8, d).to(query_dtype)
    key, value = torch.randn(tokens, hkv, d).to(query_dtype), torch.randn(tokens, hkv, d).to(query_dtype)
    context = torch.randn(2, num_blocks, block_size, hkv, d)
    kv_scale = torch.tensor([0.02, 0.04])
    cache = torch.stack([quantize_kv(context[c], cache_dtype, kv_scale[c]) for c in (0, 1)])

    def meta():
        return prepared(build_attention_metadata(query_lens, seq_lens, tables, block_size), kernels=kernels)

    mine, theirs = cache.clone(), cache.clone()
    got = cpu_paged.paged_attention(query, key, value, mine, meta(), d ** -0.5, kernels, kv_scale)
    want = portable_paged_attention(query.float(), key.float(), value.float(), theirs, meta(), d ** -0.5, kv_scale)
    assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    if query_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # bf16 outputs round once, and the bf16 prompt paths (SDPA, the causal kernels) round as they go
        torch.testing.assert_close(got.float(), want, atol=8e-3, rtol=2 ** -7)


def test_kernel_refuses_a_bad_scale_tensor() -> None:
    kernels = _kernels()
    cache = torch.zeros(2, 2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    k = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="kv_scale"):
        kernels.write_kv(k, k, cache[0], cache[1], torch.tensor([0]), torch.ones(3))
    with pytest.raises(RuntimeError, match="positive"):
        kernels.write_kv(k, k, cache[0], cache[1], torch.tensor([0]), torch.tensor([0.0, 1.0]))
