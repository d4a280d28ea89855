"""Bidirectional encoder attention on a flat batch (attention/backends/torch_encoder.py) equals per-sequence
SDPA, whatever the lengths, through its own entry point and through the shared ``Attention`` layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.backends.torch_encoder import (
    bucket_length,
    bucketed_attention,
    encoder_attention,
    plan_encoder_attention,
)
from pagedllm.attention.backends.torch_state import torch_state
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model_executor.layers.attention import Attention, attention_step, step_readers

from helpers.step_state import prepared

LENGTHS = [[5], [16, 16, 16], [1, 3, 17, 40, 9, 16, 2, 33, 100], [64, 1], [7, 300, 129, 128, 250, 12]]


def _offsets(lengths: list[int]) -> list[int]:
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return qsl


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: list[int]) -> torch.Tensor:
    out = []
    for i in range(len(qsl) - 1):
        s, e = qsl[i], qsl[i + 1]
        if s == e:
            continue
        o = F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)),
                                           enable_gqa=q.shape[1] != k.shape[1])
        out.append(o.transpose(0, 1).reshape(e - s, -1))
    return torch.cat(out)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_matches_per_sequence_sdpa(lengths, kv_heads):
    torch.manual_seed(0)
    heads, dim = 3, 8
    qsl = _offsets(lengths)
    q = torch.randn(qsl[-1], heads, dim)
    k, v = (torch.randn(qsl[-1], kv_heads, dim) for _ in range(2))
    plan = plan_encoder_attention(qsl)
    out = bucketed_attention(q, k, v, plan)
    assert out.shape == (qsl[-1], heads * dim)
    torch.testing.assert_close(out, _reference(q, k, v, qsl), atol=1e-5, rtol=1e-5)
    assert len(plan.buckets) == len({bucket_length(n) for n in lengths})


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_per_sequence_sdpa(lengths, kv_heads, dtype):
    """The C++ kernel reads q/k/v in place from a fused projection (strided rows) and attends per sequence."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    torch.manual_seed(2)
    heads, dim = 4, 32
    qsl = _offsets(lengths)
    qkv = torch.randn(qsl[-1], (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    out = kernels.encoder_attention(q, k, v, torch.tensor(qsl, dtype=torch.int32), dim ** -0.5)
    assert out.shape == (qsl[-1], heads, dim) and out.dtype == dtype and out.is_contiguous()
    ref = _reference(q.float(), k.float(), v.float(), qsl)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float().view(qsl[-1], -1), ref, atol=tol, rtol=tol)


def test_cpu_kernel_rejects_bad_offsets():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    q = torch.randn(10, 2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.encoder_attention(q, q, q, torch.tensor([0, 4, 11], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        kernels.encoder_attention(q, q, q, torch.tensor([0, 6, 4, 10], dtype=torch.int32), 1.0)


def test_bucket_lengths_pad_little():
    assert [bucket_length(n) for n in (1, 16, 17, 100, 128, 129, 256, 257)] == [16, 16, 32, 112, 128, 256, 256, 512]
    # A bucket is padded to its longest member only, not to its upper bound.
    plan = plan_encoder_attention(_offsets([18, 20, 19]))
    assert [(b.num_seqs, b.length) for b in plan.buckets] == [(3, 20)]
    assert plan.num_padded_tokens == 60


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_layer_with_encoder_spec(dtype):
    """The shared layer routes encoder specs to the encoder path (the C++ kernel on CPU, else the buckets); q/k/v
    may be views of a fused projection, and the per-step plan is built once."""
    torch.manual_seed(1)
    lengths = [4, 30, 9, 70, 30]
    qsl = _offsets(lengths)
    heads, dim = 4, 16
    layer = Attention(heads, dim, dim ** -0.5, spec=AttentionSpec.encoder())
    qkv = torch.randn(qsl[-1], 3 * heads * dim, dtype=dtype)
    q, k, v = qkv.split(heads * dim, dim=-1)
    meta = build_attention_metadata(lengths, lengths, [[] for _ in lengths], 16)
    with attention_step(meta, step_readers(layer)):
        out = layer(q, k, v)
        state = torch_state(meta)
        built = (state.encoder_plan, state.encoder_query_start)  # the buckets, or the kernel's offsets
        assert any(piece is not None for piece in built)
        torch.testing.assert_close(layer(q, k, v), out)
        assert torch_state(meta) is state and state.encoder_plan is built[0] and state.encoder_query_start is built[1]
    ref = _reference(*(t.reshape(-1, heads, dim) for t in (q, k, v)), qsl)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_a_dtype_the_kernels_lack_is_bucketed_on_a_step_prepared_for_them():
    """float16 on a CPU with the kernels: the step is prepared for the kernels (offsets, no buckets), and a query
    they cannot take is attended by the length buckets all the same, equal to each sequence alone."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    torch.manual_seed(3)
    lengths = [4, 30, 9]
    qsl = _offsets(lengths)
    heads, dim = 4, 16
    q, k, v = (torch.randn(qsl[-1], heads, dim, dtype=torch.float16) for _ in range(3))
    meta = prepared(build_attention_metadata(lengths, lengths, [[] for _ in lengths], 16), AttentionSpec.encoder(),
                    kernels=kernels)
    assert torch_state(meta).encoder_plan is None  # prepared for the kernels: offsets only
    out = encoder_attention(q, k, v, meta, dim ** -0.5, kernels)
    assert out.dtype == torch.float16 and out.shape == q.shape
    ref = _reference(q.float(), k.float(), v.float(), qsl)
    torch.testing.assert_close(out.float().view(qsl[-1], -1), ref, atol=2e-3, rtol=2e-3)


def test_chunked_sequences_are_refused():
    meta = build_attention_metadata([4, 8], [4, 12], [[], []], 16)
    with pytest.raises(ValueError, match="whole in one step"):  # preparing the step refuses it, for either path
        prepared(meta, AttentionSpec.encoder())
    with pytest.raises(ValueError, match="whole in one step"):
        prepared(meta, AttentionSpec.encoder(), kernels=_KernelSpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_equal_lengths_attend_in_place(dtype, kv_heads):
    """Sequences of one length (Whisper's 1,500-position clips) make one unpadded bucket that is attended as views of
    a fused projection's rows: the same output as the gathered path and as each sequence alone."""
    torch.manual_seed(2)
    heads, dim, lengths = 4, 16, [40, 40, 40]
    qsl = _offsets(lengths)
    qkv = torch.randn(qsl[-1], (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = (t.view(qsl[-1], -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    plan = plan_encoder_attention(qsl)
    assert plan.in_place and not plan_encoder_attention(_offsets([40, 39])).in_place
    out = bucketed_attention(q, k, v, plan)
    gathered = plan_encoder_attention(qsl)
    gathered.buckets[0].key_mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)  # forces the gather path, same math
    assert not gathered.in_place
    ref = bucketed_attention(q, k, v, gathered)
    torch.testing.assert_close(out, ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    torch.testing.assert_close(out.float(), _reference(q.float(), k.float(), v.float(), qsl),
                               atol=3e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2)


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16"])
@pytest.mark.parametrize("heads,kv_heads,dim,lengths", [
    (8, 8, 64, [1500]),  # Whisper base's encoder
    (6, 2, 64, [1, 0, 17, 33, 100, 31, 32]),  # every tail of the 16-key and 32-row blocks, an empty sequence
    (12, 12, 32, [5, 64, 129]),  # one chunk of 32 dims
])
def test_bf16_kernels_match_generic_kernel(kernel, heads, kv_heads, dim, lengths):
    """bf16 on AMX tiles or AVX-512 BF16 dot products (a polynomial exp, probabilities rounded to bf16) is as close
    to a float32 reference as torch's flash attention in bf16, and near the generic kernel, which keeps the
    probabilities in float32; q/k/v read in place from a fused projection."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    torch.manual_seed(4)
    qsl = _offsets(lengths)
    qkv = (2 * torch.randn(qsl[-1], (heads + 2 * kv_heads) * dim)).bfloat16()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    assert kernels.encoder_attention_kernels(q.float()) == ["generic"]
    assert kernels.encoder_attention_kernels(q[..., :16]) == ["generic"]
    if kernel not in kernels.encoder_attention_kernels(q):
        lacks = "AMX-BF16 tiles" if kernel == "amx" else "AVX-512 BF16"
        pytest.skip(f"this CPU cannot run the {kernel} kernel (no {lacks})")
    offsets = torch.tensor(qsl, dtype=torch.int32)
    out = kernels.encoder_attention(q, k, v, offsets, dim ** -0.5, kernel)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    out = out.float().view(qsl[-1], -1)
    generic = kernels.encoder_attention(q, k, v, offsets, dim ** -0.5, "generic").float().view(qsl[-1], -1)
    ref = _reference(q.float(), k.float(), v.float(), qsl)
    err, generic_err = (out - ref).abs(), (generic - ref).abs()
    assert err.max() <= 2 * generic_err.max() + 1e-2
    assert err.mean() <= 1.3 * generic_err.mean()
    if len(lengths) == 1:  # one sequence: SDPA's flash kernel in place, as the engine ran it before
        flash = F.scaled_dot_product_attention(*(t.view(1, *t.shape).transpose(1, 2) for t in (q, k, v)),
                                               scale=dim ** -0.5).transpose(1, 2).reshape(qsl[-1], -1).float()
        assert err.mean() <= 1.1 * (flash - ref).abs().mean()


@pytest.mark.parametrize("kernel,dtype", [("avx512_bf16", torch.bfloat16), ("generic", torch.bfloat16),
                                          ("generic", torch.float32)])
@pytest.mark.parametrize("heads,kv_heads,dim,lengths", [
    (9, 3, 64, [1, 0, 17, 33, 100, 31, 32, 64, 65]),  # a decoder's GQA; every tail of the 32-row / 32-key blocks
    (12, 12, 32, [5, 129, 40]),
])
def test_causal_kernels_match_causal_sdpa(kernel, dtype, heads, kv_heads, dim, lengths):
    """causal=True: row i of each sequence sees its keys 0 .. i only (a decoder's fresh prompts), as SDPA's
    is_causal in float32 does, within the dtype's rounding; AMX has no causal passes and is never offered."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    torch.manual_seed(6)
    qsl = _offsets(lengths)
    qkv = (2 * torch.randn(qsl[-1], (heads + 2 * kv_heads) * dim)).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    assert "amx" not in kernels.encoder_attention_kernels(q, True)
    if kernel not in kernels.encoder_attention_kernels(q, True):
        pytest.skip(f"this CPU cannot run the {kernel} kernel (no AVX-512 BF16)")
    out = kernels.encoder_attention(q, k, v, torch.tensor(qsl, dtype=torch.int32), dim ** -0.5, kernel, True)
    ref = []
    for i in range(len(lengths)):
        s, e = qsl[i], qsl[i + 1]
        if s < e:
            o = F.scaled_dot_product_attention(*(t[s:e].float().transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                               enable_gqa=heads != kv_heads)
            ref.append(o.transpose(0, 1).reshape(e - s, -1))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float().view(qsl[-1], -1), torch.cat(ref), atol=tol, rtol=tol)
    bidirectional = kernels.encoder_attention(q, k, v, torch.tensor(qsl, dtype=torch.int32), dim ** -0.5, kernel)
    assert not torch.allclose(bidirectional.float(), out.float(), atol=tol)  # the mask did something


@pytest.mark.parametrize("kernel,dtype", [("avx512_bf16", torch.bfloat16), ("generic", torch.bfloat16),
                                          ("generic", torch.float32)])
@pytest.mark.parametrize("query_lens,key_lens", [
    ([40, 1, 0, 33, 100, 64], [100, 1, 5, 300, 100, 97]),  # context of 60, none, 5 (no queries), 267, none, 33
    ([2048 - 1000], [2048]),  # a later chunk over 1,000 tokens of context
])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256)])  # SmolLM2; Gemma 3 (generic kernel only)
def test_causal_kernels_attend_chunks_over_their_context(kernel, dtype, query_lens, key_lens, heads, kv_heads, dim):
    """key_start: a sequence's queries are the last of its key positions (a later prefill chunk, the rest of a
    prefix-cache hit), and each sees the keys up to its own position: as SDPA with that mask in float32, within the
    dtype's rounding."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    torch.manual_seed(7)
    qsl, ksl = _offsets(query_lens), _offsets(key_lens)
    q = (2 * torch.randn(qsl[-1], heads * dim)).to(dtype).view(-1, heads, dim)
    kv = (2 * torch.randn(ksl[-1], 2 * kv_heads * dim)).to(dtype)
    k, v = (t.view(-1, kv_heads, dim) for t in kv.split(kv_heads * dim, dim=-1))  # strided rows, as views of qkv
    if kernel not in kernels.encoder_attention_kernels(q, True):
        if dim not in (32, 64):  # the bf16 kernels take head dims 32 and 64 only, on any CPU
            assert kernel != "generic"
            return
        pytest.skip(f"this CPU cannot run the {kernel} kernel (no AVX-512 BF16)")
    offsets, key_offsets = (torch.tensor(o, dtype=torch.int32) for o in (qsl, ksl))
    out = kernels.encoder_attention(q, k, v, offsets, dim ** -0.5, kernel, True, key_offsets)
    assert out.shape == q.shape
    ref = []
    for i, (n_q, n_k) in enumerate(zip(query_lens, key_lens)):
        if n_q:
            mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
            o = F.scaled_dot_product_attention(q[qsl[i]:qsl[i + 1]].float().transpose(0, 1),
                                               *(t[ksl[i]:ksl[i + 1]].float().transpose(0, 1) for t in (k, v)),
                                               attn_mask=mask, scale=dim ** -0.5, enable_gqa=heads != kv_heads)
            ref.append(o.transpose(0, 1).reshape(n_q, -1))
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-5  # float32: sums of 256 products differ by ~2e-5
    torch.testing.assert_close(out.float().view(qsl[-1], -1), torch.cat(ref), atol=tol, rtol=tol)
    if len(query_lens) == 1:  # the context mattered: over its own chunk's keys alone the answer differs
        own = kernels.encoder_attention(q, k[1000:], v[1000:], offsets, dim ** -0.5, kernel, True)
        assert not torch.allclose(own.float(), out.float(), atol=tol)


def test_key_start_is_checked():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    q, kv = torch.randn(10, 2, 8), torch.randn(6, 2, 8)
    qs, ks = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 4, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="sequence 1 has more queries than keys"):
        kernels.encoder_attention(q, kv, kv, qs, 1.0, "generic", True, ks)
    with pytest.raises(RuntimeError, match="key_start is out of range"):
        kernels.encoder_attention(q, kv, kv, qs, 1.0, "generic", True, torch.tensor([0, 4, 7], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="same sequences"):
        kernels.encoder_attention(q, kv, kv, qs, 1.0, "generic", True, torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sequence 1 has queries but no keys"):
        kernels.encoder_attention(q, kv, kv, qs, 1.0, "generic", False, torch.tensor([0, 4, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="do not match"):  # without key_start, queries and keys pair row by row
        kernels.encoder_attention(q, kv, kv, qs, 1.0)


def test_kernel_asked_by_name_must_be_able_to_run():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ CPU kernels on this machine (no compiler)")
    q = torch.randn(10, 2, 16)
    offsets = torch.tensor([0, 10], dtype=torch.int32)
    for name in ("amx", "avx512_bf16", "tiles"):  # float32 of head dim 16: only the generic kernel runs it
        with pytest.raises(RuntimeError, match=f"kernel '{name}' cannot run this query here.*can run: generic"):
            kernels.encoder_attention(q, q, q, offsets, 1.0, name)
    torch.testing.assert_close(kernels.encoder_attention(q, q, q, offsets, 1.0, "generic"),
                               kernels.encoder_attention(q, q, q, offsets, 1.0))
    bf16 = torch.randn(10, 2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="kernel 'amx' cannot run this query here.*causal"):
        kernels.encoder_attention(bf16, bf16, bf16, offsets, 1.0, "amx", True)


class _KernelSpy:
    """Stands in for the C++ kernels: offers the bf16 kernels it is given, records which kernel each call names."""

    def __init__(self, *bf16_kernels: str):
        self.bf16_kernels, self.calls = list(bf16_kernels), []

    def encoder_attention_kernels(self, query: torch.Tensor, causal: bool = False) -> list[str]:
        offered = [k for k in self.bf16_kernels if not (causal and k == "amx")]
        return (offered if query.dtype == torch.bfloat16 else []) + ["generic"]

    def encoder_attention(self, query, key, value, query_start, scale, kernel):
        self.calls.append(kernel)
        return torch.zeros_like(query)


@pytest.mark.parametrize("choice,expected", [("auto", "amx"), ("amx", "amx"), ("avx512_bf16", "avx512_bf16"),
                                             ("off", None)])
def test_routing_between_bf16_kernels_generic_kernel_and_buckets(monkeypatch, choice, expected):
    """Long bf16 steps go to the bf16 kernel PAGEDLLM_ENCODER_ATTENTION_BF16 picks among those the CPU has (auto:
    the fastest), else to SDPA's buckets; short steps to the generic kernel where no bf16 kernel takes them."""
    monkeypatch.setenv("PAGEDLLM_ENCODER_ATTENTION_BF16", choice)
    encoder = AttentionSpec.encoder()
    long_meta = prepared(build_attention_metadata([600], [600], [[]], 16), encoder, kernels=_KernelSpy())
    short_meta = prepared(build_attention_metadata([40], [40], [[]], 16), encoder, kernels=_KernelSpy())
    q_long, q_short = torch.randn(600, 2, 32).bfloat16(), torch.randn(40, 2, 32).bfloat16()
    spy = _KernelSpy("amx", "avx512_bf16")
    out = encoder_attention(q_long, q_long, q_long, long_meta, 1.0, spy)
    if expected:
        assert spy.calls == [expected] and not out.any()
    else:  # SDPA's buckets: a real attention output, not the spy's zeros
        assert spy.calls == [] and out.any()
    encoder_attention(q_short, q_short, q_short, short_meta, 1.0, spy)
    encoder_attention(q_short.float(), q_short.float(), q_short.float(), short_meta, 1.0, spy)
    assert spy.calls[-2:] == [expected or "generic", "generic"]
    only_dot = _KernelSpy("avx512_bf16")  # an AMD Zen 4: no tiles
    encoder_attention(q_long, q_long, q_long, long_meta, 1.0, only_dot)
    assert only_dot.calls == ([] if choice in ("amx", "off") else ["avx512_bf16"])
    neither = _KernelSpy()  # AVX2 only
    assert encoder_attention(q_long, q_long, q_long, long_meta, 1.0, neither).any() and neither.calls == []
