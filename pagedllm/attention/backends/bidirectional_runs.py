"""Runs of tokens that attend to each other both ways inside a causal layer: Gemma 3's image tokens, each image's
run one bidirectional block (transformers' ``token_type_ids`` mask). Plain torch over the paged cache, any device.

The step's backend computes every row causally and writes the step's K/V; the rows of a run are then computed
again here over the keys up to the run's end (which the scheduler puts in the same step: ``core/multimodal.py``).
A sliding-window layer keeps its window on the near side only: query p sees key j when ``p - window < j`` and
``j`` is before the run's end (transformers' AND of the window with the OR of causal and block masks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.paged_kv import dequantize_kv, is_fp8, kv_scale_of
from pagedllm.attention.metadata import AttentionMetadata


def _positions(cache: torch.Tensor, blocks: torch.Tensor, first: int, last: int, dtype: torch.dtype,
               scale: torch.Tensor | None) -> torch.Tensor:
    """Rows ``[first, last)`` of the positions held by ``blocks`` (consecutive logical blocks) -> [1, Hkv, n, D]."""
    gathered = cache[blocks]  # [nb, bs, Hkv, D]
    rows = gathered.reshape(-1, *gathered.shape[2:])[first:last].transpose(0, 1).unsqueeze(0)
    return dequantize_kv(rows, dtype, scale) if is_fp8(cache.dtype) else rows.to(dtype)


def attend_bidirectional_runs(query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int | None,
                              kv_scale: torch.Tensor | None = None) -> None:
    """Overwrite the rows of ``meta.bidirectional_runs`` in ``out`` with attention that also sees the rest of
    their run. query/out: [T, H, D]; kv_cache: [2, num_blocks, bs, Hkv, D] holding this step's K/V already;
    ``window``: the layer's sliding window (None: full); ``kv_scale``: an fp8 cache's [2] scales."""
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[-2]
    bs = meta.block_size
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for req, lo, hi, key_end in meta.bidirectional_runs or ():
        first_pos = seq_lens[req] - (qsl[req + 1] - lo)  # position of row ``lo``
        if key_end > seq_lens[req]:
            raise RuntimeError(f"attention: an image run ends at position {key_end}, past this step's "
                               f"{seq_lens[req]} tokens (the scheduler splits no run across steps)")
        key_lo = 0 if window is None else max(0, first_pos - window + 1)
        b0 = key_lo // bs
        blocks = meta.block_tables[req, b0:-(-key_end // bs)].long()
        k = _positions(kv_cache[0], blocks, key_lo - b0 * bs, key_end - b0 * bs, query.dtype,
                       kv_scale_of(kv_scale, 0))
        v = _positions(kv_cache[1], blocks, key_lo - b0 * bs, key_end - b0 * bs, query.dtype,
                       kv_scale_of(kv_scale, 1))
        mask = None
        if window is not None:
            q_pos = torch.arange(first_pos, first_pos + hi - lo, device=query.device)
            k_pos = torch.arange(key_lo, key_end, device=query.device)
            mask = k_pos[None, :] > q_pos[:, None] - window
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[lo:hi] = o[0].transpose(0, 1)
