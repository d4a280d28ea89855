"""Per-layer attention specs through the backend interface: sliding window reads only the window (vs a
dense masked reference), encoder layers attend both ways without a cache, the builder's slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.spec import AttentionSpec, common_sliding_window, layer_attention_specs

from helpers.step_state import prepared

H, HKV, D, BS = 4, 2, 8, 4


def _dense_reference(q, k, v, q_pos, kv_len, window):
    """q: [q_len, H, D]; k/v: [kv_len, Hkv, D] (positions 0..kv_len-1)."""
    kv_pos = torch.arange(kv_len)
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - window
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("window", [3, 5, 9])
def test_sliding_window_matches_dense_reference(window: int) -> None:
    torch.manual_seed(window)
    # Two decodes and a chunk with context; all longer than the window.
    query_lens, seq_lens = [1, 1, 6], [13, 20, 17]
    tables = [[3, 7, 1, 9], [2, 4, 6, 8, 10], [11, 12, 13, 14, 15]]
    meta = build_attention_metadata(query_lens, seq_lens, tables, BS)
    cache = torch.zeros(2, 16, BS, HKV, D)
    full_k = [torch.randn(s, HKV, D) for s in seq_lens]
    full_v = [torch.randn(s, HKV, D) for s in seq_lens]
    for i, s in enumerate(seq_lens):  # earlier context already in the cache
        for p in range(s - query_lens[i]):
            cache[0, tables[i][p // BS], p % BS] = full_k[i][p]
            cache[1, tables[i][p // BS], p % BS] = full_v[i][p]
    new_k = torch.cat([full_k[i][s - q:] for i, (q, s) in enumerate(zip(query_lens, seq_lens))])
    new_v = torch.cat([full_v[i][s - q:] for i, (q, s) in enumerate(zip(query_lens, seq_lens))])
    query = torch.randn(sum(query_lens), H, D)
    spec = AttentionSpec.sliding(window)
    out = TorchPagedAttentionBackend().forward(query, new_k, new_v, cache, prepared(meta, spec), spec, D ** -0.5)
    start = 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        ref = _dense_reference(query[start:start + q], full_k[i], full_v[i], torch.arange(s - q, s), s, window)
        torch.testing.assert_close(out[start:start + q], ref, atol=1e-5, rtol=0)
        causal = _dense_reference(query[start:start + q], full_k[i], full_v[i], torch.arange(s - q, s), s, None)
        assert (causal - ref).abs().max() > 1e-3  # the window changed something
        start += q


def test_sliding_layer_within_the_window_is_causal() -> None:
    spec = AttentionSpec.sliding(8)
    assert spec.window_for(8) is None and spec.window_for(9) == 8


def test_encoder_attends_both_ways_without_a_cache() -> None:
    torch.manual_seed(0)
    meta = build_attention_metadata([5, 3], [5, 3], [[], []], BS)
    q, k, v = torch.randn(8, H, D), torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    out = TorchPagedAttentionBackend().forward(q, k, v, None, prepared(meta, AttentionSpec.encoder()),
                                               AttentionSpec.encoder(), 0.5)
    for a, b in ((0, 5), (5, 8)):
        ref = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                             v[a:b].transpose(0, 1)[None], scale=0.5, enable_gqa=True)
        torch.testing.assert_close(out[a:b], ref[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_builder_slots_and_order() -> None:
    meta = build_attention_metadata([1, 3], [6, 3], [[5, 2], [7]], BS)
    assert meta.slot_mapping.tolist() == [2 * BS + 1, 7 * BS, 7 * BS + 1, 7 * BS + 2]
    assert meta.num_decodes == 1 and meta.max_seq_len == 6 and meta.query_start_loc_cpu == [0, 1, 4]
    with pytest.raises(ValueError, match="decodes"):
        build_attention_metadata([3, 1], [3, 6], [[7], [5, 2]], BS)


def test_specs_from_configs() -> None:
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    g = layer_attention_specs(Gemma3TextConfig(num_hidden_layers=12, sliding_window=512))
    assert [s.kind for s in g[:6]] == ["sliding"] * 5 + ["causal"] and g[0].window == 512
    assert common_sliding_window(g) is None
    m = layer_attention_specs(MistralConfig(num_hidden_layers=3, sliding_window=4096))
    assert common_sliding_window(m) == 4096
    assert common_sliding_window(layer_attention_specs(Qwen2Config(num_hidden_layers=2))) is None
    with pytest.raises(ValueError):
        AttentionSpec("sliding")
