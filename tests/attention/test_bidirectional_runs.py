"""Runs of tokens that attend to each other both ways inside causal and sliding-window layers (Gemma 3's images):
the rows ``attend_bidirectional_runs`` recomputes against a dense float32 reference of transformers' mask (causal OR
same run, AND the window), over a shuffled paged cache, with grouped heads, a prefix already cached, and fp8."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backends.bidirectional_runs import attend_bidirectional_runs
from pagedllm.attention.backends.paged_kv import as_stored, write_kv
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.core.multimodal import MultiModalFeature, end_outside_runs

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, runs: list[tuple[int, int]],
               window: int | None, scale: float) -> torch.Tensor:
    """q: [n, H, D] at positions q_pos; k/v: [L, Hkv, D] for positions 0..L-1 -> [n, H, D]."""
    k_pos = torch.arange(k.shape[0])
    run_of = torch.full((k.shape[0],), -1)
    for i, (a, b) in enumerate(runs):
        run_of[a:b] = i
    same = (run_of[q_pos][:, None] == run_of[None, :]) & (run_of[q_pos][:, None] >= 0)
    mask = (k_pos[None, :] <= q_pos[:, None]) | same
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    group = HEADS // KV_HEADS
    kk, vv = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("nhd,lhd->hnl", q.float(), kk) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_run_rows_equal_the_dense_mask(window: int | None, cache_dtype: torch.dtype) -> None:
    """Two requests in one step: A computes positions 0..22 with a run at 6..15; B had 8 positions cached and
    computes 8..19, its run 5..13 begun in the cache (a prefix hit ending inside it)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    lens = {"a": (0, 23, [(6, 16)]), "b": (8, 20, [(5, 14)])}
    num_blocks = 16
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, DIM, dtype=cache_dtype)
    kv_scale = torch.tensor([0.02, 0.03]) if cache_dtype != torch.float32 else None
    tables, keys, values, queries = [], [], [], []
    for start, end, _ in lens.values():
        table = [ids.pop() for _ in range(-(-end // BLOCK))]
        tables.append(table)
        k, v = torch.randn(end, KV_HEADS, DIM), torch.randn(end, KV_HEADS, DIM)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(end)])
        write_kv(cache, k, v, slots, kv_scale)
        keys.append(as_stored(k, cache_dtype, None if kv_scale is None else kv_scale[0]))
        values.append(as_stored(v, cache_dtype, None if kv_scale is None else kv_scale[1]))
        queries.append(torch.randn(end - start, HEADS, DIM))
    query_lens = [end - start for start, end, _ in lens.values()]
    meta = build_attention_metadata(query_lens, [end for _, end, _ in lens.values()], tables, BLOCK)
    runs, row = [], 0
    for index, (start, end, spans) in enumerate(lens.values()):
        for a, b in spans:
            runs.append((index, row + max(a, start) - start, row + b - start, b))
        row += end - start
    meta.bidirectional_runs = runs
    query = torch.cat(queries)
    out = torch.full_like(query, 7.0)  # rows outside the runs must stay as the backend left them
    scale = DIM ** -0.5
    attend_bidirectional_runs(query, out, cache, meta, scale, window, kv_scale)
    row = 0
    for (start, end, spans), q, k, v in zip(lens.values(), queries, keys, values):
        ref = _reference(q, k, v, torch.arange(start, end), spans, window, scale)
        got = out[row:row + end - start]
        in_run = torch.zeros(end - start, dtype=torch.bool)
        for a, b in spans:
            in_run[max(a, start) - start:b - start] = True
        torch.testing.assert_close(got[in_run], ref[in_run], rtol=1e-5, atol=1e-5)
        assert (got[~in_run] == 7.0).all()
        row += end - start


def test_a_run_past_the_step_is_an_error() -> None:
    cache = torch.zeros(2, 4, BLOCK, KV_HEADS, DIM)
    meta = build_attention_metadata([6], [6], [[1, 2]], BLOCK)
    meta.bidirectional_runs = [(0, 2, 6, 9)]  # the run ends at position 9, past the step's 6 tokens
    with pytest.raises(RuntimeError, match="past this step"):
        attend_bidirectional_runs(torch.zeros(6, HEADS, DIM), torch.zeros(6, HEADS, DIM), cache, meta, 1.0, None)


def test_runs_follow_the_embed_mask_and_chunks_stop_outside_them() -> None:
    plain = MultiModalFeature("a", offset=4, length=6)
    tiled = MultiModalFeature("b", offset=20, length=7, embed_mask=bytes([1, 1, 0, 1, 1, 1, 0]))
    assert plain.runs() == [(4, 10)]
    assert tiled.runs() == [(20, 22), (23, 26)]
    features = [plain, tiled]
    assert end_outside_runs(features, 0, 7) == 4  # would split the first run: stop before it
    assert end_outside_runs(features, 0, 10) == 10  # ends with it
    assert end_outside_runs(features, 0, 24) == 23  # inside the second tile's run
    assert end_outside_runs(features, 22, 23) == 23  # the tag between two runs
    assert end_outside_runs(features, 6, 8) == 6  # begins inside a run and cannot finish it: nothing now
    assert end_outside_runs(features, 6, 12) == 12
