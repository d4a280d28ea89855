"""Attention with sinks (gpt-oss) on the paged cache against a dense reference written from the formula: decodes,
chunks and fresh prompts in one step, GQA, causal and sliding-window layers, scattered block tables; with sinks at
-inf it is plain attention (the torch backend's)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.attention.backends.torch_sinks import sink_attention
from pagedllm.attention.spec import AttentionSpec

from helpers.step_state import prepared

QUERY_LENS = [1, 1, 1, 7, 13]  # three decodes, a chunk with context, a fresh prompt
SEQ_LENS = [9, 30, 2, 25, 13]


def _step(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    """(metadata, zeroed cache, the whole sequences' K/V [S, Hkv, D] per request, this step's query/key/value)."""
    from pagedllm.attention.metadata import build_attention_metadata

    rng = random.Random(seed)
    torch.manual_seed(seed)
    ids = list(range(1, 64))
    rng.shuffle(ids)
    tables, start = [], 0
    for s in SEQ_LENS:
        n = -(-s // block_size)
        tables.append(ids[start:start + n])
        start += n
    meta = prepared(build_attention_metadata(QUERY_LENS, SEQ_LENS, tables, block_size))
    cache = torch.zeros(2, 64, block_size, num_kv_heads, head_dim)
    full_k = [torch.randn(s, num_kv_heads, head_dim) for s in SEQ_LENS]
    full_v = [torch.randn(s, num_kv_heads, head_dim) for s in SEQ_LENS]
    for table, k, v, q_len in zip(tables, full_k, full_v, QUERY_LENS, strict=True):  # the context is in the cache
        for pos in range(k.shape[0] - q_len):
            cache[0, table[pos // block_size], pos % block_size] = k[pos]
            cache[1, table[pos // block_size], pos % block_size] = v[pos]
    new_k = torch.cat([k[-q:] for k, q in zip(full_k, QUERY_LENS, strict=True)])
    new_v = torch.cat([v[-q:] for v, q in zip(full_v, QUERY_LENS, strict=True)])
    query = torch.randn(sum(QUERY_LENS), num_heads, head_dim)
    return meta, cache, full_k, full_v, query, new_k, new_v


def _reference(query, full_k, full_v, sinks, scale, window):
    """Each request's queries against its whole K/V with the sink logit in the denominator, dense and per head."""
    outs, start = [], 0
    group = query.shape[1] // full_k[0].shape[1]
    for k, v, q_len in zip(full_k, full_v, QUERY_LENS, strict=True):
        q = query[start:start + q_len]
        start += q_len
        seq = k.shape[0]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, H, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        q_pos, k_pos = torch.arange(seq - q_len, seq)[:, None], torch.arange(seq)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        logits = torch.cat([scores, sinks[:, None, None].expand(-1, q_len, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        outs.append(torch.einsum("hqs,shd->qhd", probs, v))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 2, 4), (6, 1, 8), (2, 2, 16)])
def test_sink_attention_equals_the_formula(window, num_heads, num_kv_heads, block_size) -> None:
    meta, cache, full_k, full_v, query, new_k, new_v = _step(block_size, num_heads, num_kv_heads, 16, seed=1)
    sinks = torch.randn(num_heads) * 2
    got = sink_attention(query, new_k, new_v, cache, meta, 0.25, sinks, window)
    torch.testing.assert_close(got, _reference(query, full_k, full_v, sinks, 0.25, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_at_minus_infinity_are_plain_attention(window) -> None:
    meta, cache, _, _, query, new_k, new_v = _step(4, 4, 2, 16, seed=2)
    got = sink_attention(query, new_k, new_v, cache.clone(), meta, 0.25, torch.full((4,), float("-inf")), window)
    spec = AttentionSpec.causal() if window is None else AttentionSpec.sliding(window)
    meta = prepared(meta, spec)
    want = TorchPagedAttentionBackend().forward(query, new_k, new_v, cache.clone(), meta, spec, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
