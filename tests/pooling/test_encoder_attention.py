"""Bidirectional encoder attention on a flat batch equals per-sequence SDPA, whatever the lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.encoder_attention import encoder_attention, plan_encoder_attention


@pytest.mark.parametrize("lengths", [[5], [16, 16, 16], [1, 3, 17, 40, 9, 16, 2, 33, 100], [64, 1]])
def test_matches_per_sequence_sdpa(lengths):
    torch.manual_seed(0)
    heads, dim = 3, 8
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    q, k, v = (torch.randn(qsl[-1], heads, dim) for _ in range(3))
    out = encoder_attention(q, k, v, qsl)
    assert out.shape == (qsl[-1], heads * dim)
    for i in range(len(lengths)):
        s, e = qsl[i], qsl[i + 1]
        ref = F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)))
        torch.testing.assert_close(out[s:e], ref.transpose(0, 1).reshape(e - s, heads * dim), atol=1e-5, rtol=1e-5)
    # A precomputed plan gives the same result, and buckets stay few.
    plan = plan_encoder_attention(qsl)
    assert len(plan.buckets) <= 5
    torch.testing.assert_close(encoder_attention(q, k, v, qsl, plan=plan), out)
