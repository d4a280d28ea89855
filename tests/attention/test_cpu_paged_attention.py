"""The C++ CPU paged-attention kernel against the portable gather + SDPA path."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backends.torch_sdpa import _attend_with_context
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.kernels.cpu import load_cpu_kernels

from helpers.step_state import prepared


def _prepared_metadata(*args, **kwargs):
    """A step's metadata with its causal layers' state built, as the runner prepares each step."""
    return prepared(build_attention_metadata(*args, **kwargs))


def _scattered_tables(seq_lens: list[int], block_size: int, rng: random.Random, num_ids: int) -> list[list[int]]:
    """Block tables over ids 1 .. num_ids - 1 in shuffled order: non-contiguous, out-of-order physical blocks."""
    ids = list(range(1, num_ids))
    rng.shuffle(ids)
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(ids[:n])
        ids = ids[n:]
    return tables


def _batch(query_lens: list[int], seq_lens: list[int], block_size: int, cache_dtype: torch.dtype, rng: random.Random,
           num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64):
    """(metadata, random caches [2, blocks, block_size, Hkv, D], random query [T, H, D]) for a step of these lengths."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    meta = _prepared_metadata(query_lens, seq_lens, _scattered_tables(seq_lens, block_size, rng, num_blocks),
                              block_size)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    return meta, cache, torch.randn(sum(query_lens), num_heads, head_dim)


def _case(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
          chunk_len: int, seed: int, cache_dtype: torch.dtype = torch.float32):
    """Random caches and a decodes-first batch: half decodes, half chunks of chunk_len with context."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    query_lens = [1] * (num_reqs - num_reqs // 2) + [chunk_len] * (num_reqs // 2)
    seq_lens = [q + rng.randrange(0, 70) for q in query_lens]
    return _batch(query_lens, seq_lens, block_size, cache_dtype, rng, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("num_reqs", [2, 24])  # few: a task per KV head; many: a task per request
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (9, 3, 64),   # SmolLM2: 3 query heads per KV head, vector paths
    (8, 2, 32),   # 4 per KV head: tiles of 3 + 1
    (7, 1, 16),   # 7 per KV head: tiles of 3 + 3 + 1
    (4, 2, 48),   # AVX-512: three 16-column chunks per sweep over V
    (2, 1, 80),   # AVX-512: sweeps of 4 + 1 chunks
    (4, 4, 8),    # no GQA; D % 16 != 0 takes the scalar V path
    (6, 3, 12),   # D % 8 != 0: scalar everywhere
])
# 64 and 40: blocks scored and summed in pieces of 16 rows (40: a piece of 8 at each block's end).
@pytest.mark.parametrize("block_size", [16, 5, 64, 40])
def test_kernel_matches_portable_path(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                                      block_size: int) -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C++ CPU kernel must build on the test machine"
    meta, cache, query = _case(num_reqs, num_heads, num_kv_heads, head_dim, block_size, chunk_len=7, seed=num_reqs)
    got, expected = _kernel_and_portable(kernels, query, cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def _kernel_and_portable(kernels, query, cache, meta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request of ``meta`` attended by the C++ kernel and by the portable path."""
    expected = torch.zeros_like(query)
    _attend_with_context(query, cache, meta, list(range(meta.num_reqs)), scale, expected)
    got = torch.zeros_like(query)
    kernels.paged_attention(query, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            got, scale, torch.arange(meta.num_reqs, dtype=torch.int32))
    return got, expected


def _long_context_case(query_lens: list[int], seq_lens: list[int], block_size: int, cache_dtype: torch.dtype):
    torch.manual_seed(1)
    return _batch(query_lens, seq_lens, block_size, cache_dtype, random.Random(1))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5, 64, 40])
def test_long_contexts_in_partitions_match_portable_path(cache_dtype: torch.dtype, block_size: int) -> None:
    """Contexts longer than a partition (256 keys) are attended in partitions combined afterwards: decodes of
    1, 2 and 5 partitions, and a chunk whose earlier tokens see fewer partitions than its last."""
    kernels = load_cpu_kernels()
    query_lens = [1, 1, 1, 40]
    seq_lens = [700, 257, 1201, 290]  # the chunk's tokens see 251 .. 290 keys: one or two partitions
    meta, cache, query = _long_context_case(query_lens, seq_lens, block_size, cache_dtype)
    got, expected = _kernel_and_portable(kernels, query, cache, meta, 64 ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_long_contexts_with_a_bf16_query() -> None:
    """A bf16 model's query over partitioned contexts: its bf16 output within one bf16 step of the float32
    portable path on the same (bf16) K/V."""
    kernels = load_cpu_kernels()
    meta, cache, query = _long_context_case([1, 1, 40], [700, 1201, 290], 16, torch.bfloat16)
    q16 = query.bfloat16()
    expected = torch.zeros_like(query)
    _attend_with_context(q16.float(), cache.float(), meta, list(range(meta.num_reqs)), 0.125, expected)
    got = torch.zeros_like(q16)
    kernels.paged_attention(q16, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, got,
                            0.125, torch.arange(meta.num_reqs, dtype=torch.int32))
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=2e-3)


def test_a_long_request_attends_the_same_alone_or_batched() -> None:
    """Partitions depend on a request's own context only: its output is bit-identical whether it runs alone (a
    task per KV head) or among many requests (a task per request)."""
    kernels = load_cpu_kernels()
    query_lens = [1] * 24
    seq_lens = [900] + [20 + 37 * i for i in range(23)]
    meta, cache, query = _long_context_case(query_lens, seq_lens, 16, torch.float32)
    batched = torch.zeros_like(query)
    kernels.paged_attention(query, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            batched, 0.125, torch.arange(24, dtype=torch.int32))
    alone = torch.zeros_like(query)
    kernels.paged_attention(query, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            alone, 0.125, torch.zeros(1, dtype=torch.int32))
    assert torch.equal(alone[0], batched[0])


@pytest.mark.parametrize("num_reqs", [2, 10])  # a task per KV head, or per request
def test_long_chunks_split_into_tasks_of_query_rows(num_reqs: int) -> None:
    """Chunks of 70 and 33 tokens after earlier context span several 32-row tasks (and a 1-row tail)."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    for chunk_len in (70, 33):
        meta, cache, query = _case(num_reqs, 9, 3, 64, 16, chunk_len=chunk_len, seed=chunk_len)
        expected = torch.zeros_like(query)
        _attend_with_context(query, cache, meta, list(range(meta.num_reqs)), 0.125, expected)
        got = torch.zeros_like(query)
        kernels.paged_attention(query, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                got, 0.125, torch.arange(meta.num_reqs, dtype=torch.int32))
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_kernel_reads_bf16_cache() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None
    meta, cache, query = _case(6, 9, 3, 64, 16, chunk_len=4, seed=3, cache_dtype=torch.bfloat16)
    expected = torch.zeros_like(query)
    _attend_with_context(query, cache.float(), meta, list(range(meta.num_reqs)), 0.125, expected)
    got = torch.zeros_like(query)
    kernels.paged_attention(query, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            got, 0.125, torch.arange(meta.num_reqs, dtype=torch.int32))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def _bf16_reference(query: torch.Tensor, cache: torch.Tensor, meta, scale: float, round_p: bool) -> torch.Tensor:
    """Attention as the kernel does it for a bf16 query and cache: float32 scores and softmax numerators, the
    numerators rounded to bf16 for the sum over V where ``round_p`` (the AVX-512 BF16 dot products, as PyTorch's
    flash attention rounds P; other builds sum float32 P), the output to bf16."""
    out = torch.zeros_like(query)
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = query.shape[1] // num_kv_heads
    qsl, seq_lens = list(meta.query_start_loc_cpu), meta.seq_lens.tolist()
    for r in range(meta.num_reqs):
        q_len, seq_len = qsl[r + 1] - qsl[r], seq_lens[r]
        slots = [meta.block_tables[r, t // block_size].item() * block_size + t % block_size for t in range(seq_len)]
        k = cache[0].flatten(0, 1)[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [H, seq, D]
        v = cache[1].flatten(0, 1)[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        for j in range(q_len):
            ctx = seq_len - q_len + j + 1
            s = (query[qsl[r] + j].float()[:, None, :] @ k[:, :ctx].transpose(1, 2))[:, 0] * scale  # [H, ctx]
            e = torch.exp(s - s.max(-1, keepdim=True).values)
            p = e.bfloat16().float() if round_p else e
            o = (p[:, None, :] @ v[:, :ctx])[:, 0] / e.sum(-1, keepdim=True)
            out[qsl[r] + j] = o.to(query.dtype)
    return out


@pytest.mark.parametrize("allow_amx", [True, False])
@pytest.mark.parametrize("block_size", [16, 64, 40])
def test_bf16_query_and_output_match_the_bf16_reference(allow_amx: bool, block_size: int) -> None:
    """A bf16 model's query goes in as bf16 and its output comes back in bf16: the numbers of _bf16_reference to
    within one bf16 step (dot products summed in another order), nearly all equal; odd context lengths pair the
    last key with zeros. allow_amx=False keeps the scores on AVX-512 dot products where AMX would take them."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    meta, cache, query = _case(7, 9, 3, 64, block_size, chunk_len=3, seed=5, cache_dtype=torch.bfloat16)
    assert any(n % 2 for n in meta.seq_lens.tolist()) and any(n % 2 == 0 for n in meta.seq_lens.tolist())
    rows = torch.arange(meta.num_reqs, dtype=torch.int32)
    q16 = query.bfloat16()
    expected = _bf16_reference(q16, cache, meta, 0.125, round_p=kernels.built_for_avx512_bf16)
    got = torch.zeros_like(q16)
    kernels.paged_attention(q16, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, got,
                            0.125, rows, allow_amx=allow_amx)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-4)
    assert (got == expected).float().mean() > 0.99
    with pytest.raises(RuntimeError, match="both"):
        kernels.paged_attention(q16, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                torch.zeros_like(query), 0.125, rows)
    with pytest.raises(RuntimeError, match="bfloat16 or fp8 cache"):
        kernels.paged_attention(q16, cache[0].float(), cache[1].float(), meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, got, 0.125, rows)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 32), (4, 1, 96), (16, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_amx_scores_equal_the_avx512_dot_products(num_heads: int, num_kv_heads: int, head_dim: int,
                                                  block_size: int) -> None:
    """Where the CPU grants AMX-BF16 tiles, a bf16 query's scores come from tdpbf16ps: the same outputs as the
    AVX-512 dot products to within one bf16 step, over decodes, chunks, tile tails and partitioned contexts."""
    kernels = load_cpu_kernels()
    if not kernels.amx_bf16_supported():
        pytest.skip("this CPU has no AMX-BF16 (or the kernel refused the tile state): the AMX scores cannot run")
    torch.manual_seed(3)
    meta, cache, query = _batch([1, 1, 1, 1, 5, 17], [37, 300, 16, 1, 64, 533], block_size, torch.bfloat16,
                                random.Random(3), num_heads, num_kv_heads, head_dim)
    q16, rows = query.bfloat16(), torch.arange(meta.num_reqs, dtype=torch.int32)
    outs = []
    for allow_amx in (True, False):
        out = torch.zeros_like(q16)
        kernels.paged_attention(q16, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                out, head_dim ** -0.5, rows, allow_amx=allow_amx)
        outs.append(out)
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2 ** -7, atol=1e-4)
    assert (outs[0] == outs[1]).float().mean() > 0.99


def test_kernel_only_touches_listed_requests() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None
    meta, cache, query = _case(6, 9, 3, 64, 16, chunk_len=4, seed=5)
    got = torch.full_like(query, 7.0)
    listed = [0, 2, 4]
    kernels.paged_attention(query, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            got, 0.125, torch.tensor(listed, dtype=torch.int32))
    expected = torch.full_like(query, 7.0)
    _attend_with_context(query, cache, meta, listed, 0.125, expected)
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_reqs):
        rows = slice(qsl[i], qsl[i + 1])
        if i in listed:
            torch.testing.assert_close(got[rows], expected[rows], atol=2e-5, rtol=1e-4)
        else:
            assert torch.all(got[rows] == 7.0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])  # bf16: --kv-cache-dtype, float32 model
@pytest.mark.parametrize("choice", ["auto", "kernel", "sdpa"])  # PAGEDLLM_PROMPT_ATTENTION_FLOAT32
def test_backend_routes_fresh_prompts_by_length(monkeypatch, cache_dtype: torch.dtype, choice: str) -> None:
    """A mixed step (decodes, a chunk with context, short and long fresh prompts) through the backend: the kernel
    path (short fresh prompts in the paged kernel; with kernels built for AVX-512, or the switch forcing it, long
    ones in the causal generic kernel, one call for the adjacent two, and the chunk too, over its K/V gathered in
    float32; else SDPA) equals the portable path (SDPA)."""
    import pagedllm.attention.backends.cpu_paged as backend

    assert load_cpu_kernels() is not None
    rng = random.Random(0)
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    monkeypatch.setattr(backend, "FRESH_PROMPT_KERNEL_MAX_LEN", 40)
    query_lens = [1, 1, 1, 9, 5, 40, 41, 70]
    seq_lens = [30, 17, 64, 50, 5, 40, 41, 70]  # the last four are fresh prompts (seq_len == q_len)
    tables = _scattered_tables(seq_lens, block_size, rng, 200)
    meta = _prepared_metadata(query_lens, seq_lens, tables, block_size)
    tokens = sum(query_lens)
    query = torch.randn(tokens, num_heads, head_dim)
    key, value = torch.randn(tokens, num_kv_heads, head_dim), torch.randn(tokens, num_kv_heads, head_dim)
    cache = torch.randn(2, 200, block_size, num_kv_heads, head_dim).to(cache_dtype)  # the first four's context

    split = backend.kernel_split(backend.step_plan(meta), 40, backend.CONTEXT_CHUNK_KERNEL_MAX_LEN)
    assert split.kernel_rows.tolist() == [0, 1, 2, 3, 4, 5] and split.long_fresh == {41: [6], 70: [7]}
    assert split.long_chunks == []
    # A chunk with context longer than the kernel's limit goes to the causal kernel or SDPA, over its gathered K/V.
    split = backend.kernel_split(backend.step_plan(meta), 40, 8)
    assert split.kernel_rows.tolist() == [0, 1, 2, 4, 5] and split.long_chunks == [3]
    monkeypatch.setattr(backend, "CONTEXT_CHUNK_KERNEL_MAX_LEN", 8)
    monkeypatch.setenv("PAGEDLLM_PROMPT_ATTENTION_FLOAT32", choice)
    kernels = _KernelsSpy(load_cpu_kernels())
    got = backend.paged_attention(query, key, value, cache.clone(), meta, head_dim ** -0.5, kernels)
    in_kernel = [("generic", [0, 9], [0, 50]), ("generic", [0, 41, 111], None)]
    takes = choice == "kernel" or (choice == "auto" and kernels.built_for_avx512)
    assert kernels.causal_calls == (in_kernel if takes else [])
    expected = backend.paged_attention(query, key, value, cache.clone(),
                                       _prepared_metadata(query_lens, seq_lens, tables, block_size),
                                       head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_kernel_write_kv_converts_between_float32_and_bf16() -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: the C++ store rounds to nearest even exactly as torch's
    cast (and the portable store) does, from strided rows (slices of the fused qkv output)."""
    from pagedllm.attention.backends.paged_kv import write_kv

    kernels = load_cpu_kernels()
    torch.manual_seed(0)
    qkv = torch.randn(37, 3 * 192) * 3
    key, value = qkv[:, 192:384].view(37, 3, 64), qkv[:, 384:].view(37, 3, 64)
    slots = torch.randperm(8 * 16)[:37]
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=torch.bfloat16)
    kernels.write_kv(key, value, cache[0], cache[1], slots)
    flat = cache.view(2, -1, 3, 64)
    assert torch.equal(flat[0][slots], key.to(torch.bfloat16)) and torch.equal(flat[1][slots], value.to(torch.bfloat16))
    portable = torch.zeros_like(cache)
    write_kv(portable, key, value, slots)
    assert torch.equal(portable, cache)
    # and the other way (--kv-cache-dtype float32 under a bf16 model): bf16 rows widened exactly
    wide = torch.zeros(2, 8, 16, 3, 64)
    kernels.write_kv(key.to(torch.bfloat16), value.to(torch.bfloat16), wide[0], wide[1], slots)
    assert torch.equal(wide.view(2, -1, 3, 64)[0][slots], key.to(torch.bfloat16).float())
    assert torch.equal(wide.view(2, -1, 3, 64)[1][slots], value.to(torch.bfloat16).float())
    with pytest.raises(RuntimeError, match="must match the cache"):
        kernels.write_kv(key.half(), value.half(), cache[0], cache[1], slots)


def test_long_fresh_prompt_attends_to_its_kv_as_the_cache_keeps_it(monkeypatch) -> None:
    """A fresh prompt past the paged kernel's length is attended over the step's own K/V (the causal kernel): with a
    bf16 cache it must see them rounded as stored, as a later chunk of the same prompt (read from the cache) would."""
    import torch.nn.functional as F

    import pagedllm.attention.backends.cpu_paged as backend

    monkeypatch.setattr(backend, "FRESH_PROMPT_KERNEL_MAX_LEN", 8)
    torch.manual_seed(1)
    q_len, num_heads, num_kv_heads, head_dim = 40, 4, 2, 32
    meta = _prepared_metadata([q_len], [q_len], [[1, 2, 3]], 16)
    query = torch.randn(q_len, num_heads, head_dim)
    key, value = torch.randn(q_len, num_kv_heads, head_dim), torch.randn(q_len, num_kv_heads, head_dim)
    cache = torch.zeros(2, 4, 16, num_kv_heads, head_dim, dtype=torch.bfloat16)
    got = backend.paged_attention(query, key, value, cache, meta, 0.2, load_cpu_kernels())
    rounded = [t.to(torch.bfloat16).float().transpose(0, 1)[None] for t in (key, value)]
    want = F.scaled_dot_product_attention(query.transpose(0, 1)[None], *rounded, is_causal=True, scale=0.2,
                                          enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bf16_queries_leave_shorter_prompts_and_chunks_to_sdpa(monkeypatch) -> None:
    """With native bf16 a bf16 query's shorter fresh prompts and chunks go to SDPA (its bf16 matmuls), and a mixed
    bf16 step through the backend stays within bf16 rounding of the portable path."""
    import pagedllm.attention.backends.cpu_paged as backend
    from pagedllm.platforms.cpu import CpuPlatform

    q32 = torch.zeros(1, 9, 64)
    monkeypatch.setattr(CpuPlatform, "onednn_bf16", lambda self: False)
    assert backend.kernel_limits(q32.bfloat16()) == (backend.FRESH_PROMPT_KERNEL_MAX_LEN,
                                                     backend.CONTEXT_CHUNK_KERNEL_MAX_LEN)
    monkeypatch.setattr(CpuPlatform, "onednn_bf16", lambda self: True)
    assert backend.kernel_limits(q32) == (backend.FRESH_PROMPT_KERNEL_MAX_LEN, backend.CONTEXT_CHUNK_KERNEL_MAX_LEN)
    limits = backend.kernel_limits(q32.bfloat16())
    assert limits == (backend.BF16_FRESH_PROMPT_KERNEL_MAX_LEN, backend.BF16_CONTEXT_CHUNK_KERNEL_MAX_LEN)
    assert limits[0] < backend.FRESH_PROMPT_KERNEL_MAX_LEN and limits[1] < backend.CONTEXT_CHUNK_KERNEL_MAX_LEN

    query_lens = [1, 1, 9, 40, 12, 70]
    seq_lens = [30, 300, 50, 80, 12, 70]  # decodes, chunks of 9 (kernel) and 40 (SDPA), fresh prompts of 12 and 70
    meta, cache, query = _long_context_case(query_lens, seq_lens, 16, torch.bfloat16)
    tokens = sum(query_lens)
    key, value = (torch.randn(tokens, 3, 64).bfloat16() for _ in range(2))
    split = backend.kernel_split(backend.step_plan(meta), *limits)
    assert split.kernel_rows.tolist() == [0, 1, 2, 4] and split.long_chunks == [3] and split.long_fresh == {70: [5]}
    got = backend.paged_attention(query.bfloat16(), key, value, cache.clone(), meta, 0.125, load_cpu_kernels())
    expected = backend.paged_attention(query.bfloat16().float(), key.float(), value.float(), cache.float(),
                                       _prepared_metadata(query_lens, seq_lens, meta.block_tables.tolist(), 16),
                                       0.125)
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=4e-3)


class _KernelsSpy:
    """The C++ kernels, with the causal encoder_attention calls recorded (their query and key offsets)."""

    def __init__(self, kernels):
        self._kernels, self.causal_calls = kernels, []

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def encoder_attention(self, query, key, value, query_start, scale, kernel="auto", causal=False, key_start=None):
        if causal:
            self.causal_calls.append((kernel, query_start.tolist(), None if key_start is None else key_start.tolist()))
        return self._kernels.encoder_attention(query, key, value, query_start, scale, kernel, causal, key_start)


@pytest.mark.parametrize("choice", ["auto", "avx512_bf16", "off"])
def test_bf16_fresh_prompts_go_to_the_causal_kernel_without_amx(monkeypatch, choice: str) -> None:
    """bf16 prompts past the paged kernel's lengths run in the causal bf16 kernel where the CPU has AVX-512 BF16 and
    no AMX tiles (or the switch forces it): fresh ones one call per run of adjacent requests, chunks with context one
    call each over their gathered K/V; within bf16 rounding of the portable path. With AMX tiles, or the switch off,
    they stay in SDPA."""
    import pagedllm.attention.backends.cpu_paged as backend
    from pagedllm.attention.backends.torch_encoder import bf16_kernel

    monkeypatch.setenv("PAGEDLLM_ENCODER_ATTENTION_BF16", choice)
    kernels = _KernelsSpy(load_cpu_kernels())
    query_lens = [1, 9, 70, 100, 40, 65, 12]
    # fresh prompts of 70 and 100 (adjacent), 65 (alone) and 12 (paged kernel); chunks of 9 (paged kernel) and 40
    seq_lens = [30, 50, 70, 100, 80, 65, 12]
    meta, cache, query = _long_context_case(query_lens, seq_lens, 16, torch.bfloat16)
    tokens = sum(query_lens)
    key, value = (torch.randn(tokens, 3, 64).bfloat16() for _ in range(2))
    got = backend.paged_attention(query.bfloat16(), key, value, cache.clone(), meta, 0.125, kernels)
    expected = backend.paged_attention(query.bfloat16().float(), key.float(), value.float(), cache.float(),
                                       _prepared_metadata(query_lens, seq_lens, meta.block_tables.tolist(), 16),
                                       0.125)
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=4e-3)
    able = kernels.encoder_attention_kernels(query.bfloat16(), True)
    has_amx = "amx" in kernels.encoder_attention_kernels(query.bfloat16())
    takes = "avx512_bf16" in able and (choice == "avx512_bf16" or (choice == "auto" and not has_amx))
    assert bf16_kernel(kernels, query.bfloat16(), causal=True) == ("avx512_bf16" if takes else None)
    assert bf16_kernel(kernels, query, causal=True) is None  # float32
    if takes:
        assert kernels.causal_calls == [("avx512_bf16", [0, 40], [0, 80]), ("avx512_bf16", [0, 70, 170], None),
                                        ("avx512_bf16", [0, 65], None)]
    else:
        assert kernels.causal_calls == []


def test_queries_with_heads_apart_go_through_the_paged_kernel() -> None:
    """A query whose heads are not one row per token (a transposed view, not a fused projection's) is copied for
    the paged kernel, which reads each token's heads as one row: a decode and a short fresh prompt, float32 and
    bf16, as from the query's contiguous copy."""
    import pagedllm.attention.backends.cpu_paged as backend

    kernels = load_cpu_kernels()
    assert kernels is not None
    meta = _prepared_metadata([1, 12], [40, 12], [[0, 1, 2], [3]], 16)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(4)
        query = torch.randn(4, 13, 64).to(dtype).transpose(0, 1)  # [T, H, D] with the heads 13 rows apart
        key, value = (torch.randn(13, 2, 64).to(dtype) for _ in range(2))
        cache = torch.randn(2, 8, 16, 2, 64).to(dtype)
        got = backend.paged_attention(query, key, value, cache.clone(), meta, 0.125, kernels)
        want = backend.paged_attention(query.contiguous(), key, value, cache.clone(), meta, 0.125, kernels)
        assert torch.equal(got, want)


def test_bf16_fresh_prompts_with_other_layouts_stay_in_sdpa(monkeypatch) -> None:
    """q/k/v whose heads are not contiguous within a token's row (not views of a fused projection) are attended by
    SDPA, not refused by the kernel."""
    import pagedllm.attention.backends.cpu_paged as backend

    monkeypatch.setenv("PAGEDLLM_ENCODER_ATTENTION_BF16", "avx512_bf16")
    kernels = _KernelsSpy(load_cpu_kernels())
    meta = _prepared_metadata([80], [80], [[0, 1, 2, 3, 4]], 16)
    torch.manual_seed(3)
    query = torch.randn(4, 80, 64).bfloat16().transpose(0, 1)  # [T, H, D] with the heads 80 rows apart
    key, value = (torch.randn(80, 2, 64).bfloat16() for _ in range(2))
    cache = torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16)
    got = backend.paged_attention(query, key, value, cache, meta, 0.125, kernels)
    assert kernels.causal_calls == []
    want = backend.paged_attention(query.contiguous(), key, value, cache.clone(), meta, 0.125, kernels)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=4e-3)
