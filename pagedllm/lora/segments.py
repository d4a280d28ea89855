"""The grouped LoRA term of one step: every adapter's rows in one pair of batched matmuls (Punica's SGMV idea).

Per step, ``plan_step`` sorts the rows that carry an adapter by slot (base rows are left out: they get no term) and
lays them out in tiles of L rows, each tile holding rows of one slot (padded up to L). Every LoRA layer of the step
then computes, with no Python loop over adapters::

    xs = x[rows]                        [tiles * L, K]
    h  = bmm(xs, A[slot of t])          [tiles, L, R]     A: [max_loras, K, R] slot buffer
    y[rows] += bmm(h, B[slot of t])     [tiles, L, N]     B: [max_loras, R, N], scaling folded in

Two layouts, chosen per step once for all layers from the run lengths:

- direct: one tile per slot of a contiguous range lo..hi (a slot of the range with no row gets an all-padding
  tile), L = the longest run; A and B are then views ``A[lo:hi]``, never copied. Decode steps take it.
- tiled: runs cut into tiles of a power-of-two L, each tile gathering its slot's A and B; a long prefill beside
  short decodes takes it (the direct layout would pad every slot to the prefill's length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAStepPlan:
    """One step's rows by adapter slot, shared by every LoRA layer of the forward.

    ``gather`` [tiles * L] int64: the row of x behind each tile position (padding repeats a real row);
    ``slot_range``: (lo, hi) for the direct layout (tile t is slot lo + t), else None and ``tile_slots`` [tiles]
    int64 gives each tile's slot; ``scatter_pos`` / ``scatter_rows``: the real positions of ``gather`` and their
    rows of y (``scatter_pos`` None when no position is padding: then ``scatter_rows`` is ``gather`` itself).
    """

    num_tokens: int
    tile_rows: int
    num_tiles: int
    gather: torch.Tensor
    slot_range: tuple[int, int] | None
    tile_slots: torch.Tensor | None
    scatter_pos: torch.Tensor | None
    scatter_rows: torch.Tensor


def choose_tile_rows(run_lengths: list[int], rank_width: int) -> tuple[int, int]:
    """(tile length, cost) of the tiled layout: the power of two with the least padded rows plus weight copies
    (a tile's copy of A and B costs about ``rank_width`` rows)."""
    longest = max(run_lengths)
    best, best_cost, length = 1, None, 1
    while True:
        tiles = sum(-(-n // length) for n in run_lengths)
        cost = tiles * length + tiles * rank_width
        if best_cost is None or cost < best_cost:
            best, best_cost = length, cost
        if length >= longest:
            return best, best_cost
        length *= 2


def plan_step(request_slots: Sequence[int], query_lens: Sequence[int], rank_width: int,
              device: torch.device) -> LoRAStepPlan | None:
    """The plan for a step whose request i has ``query_lens[i]`` rows (in order) and adapter slot
    ``request_slots[i]`` (-1: the base model); None when no row carries an adapter (the layers add nothing)."""
    runs: dict[int, list[int]] = {}
    row = 0
    for slot, num_rows in zip(request_slots, query_lens):
        if slot >= 0:
            runs.setdefault(slot, []).extend(range(row, row + num_rows))
        row += num_rows
    if not runs:
        return None
    lengths = [len(r) for r in runs.values()]
    tile, tiled_cost = choose_tile_rows(lengths, rank_width)
    lo, hi = min(runs), max(runs) + 1
    direct = (hi - lo) * max(lengths) <= tiled_cost
    if direct:
        tile = max(lengths)
    gather: list[int] = []
    tile_slots: list[int] = []
    positions: list[int] = []
    any_row = next(iter(runs.values()))[0]
    for slot in range(lo, hi) if direct else sorted(runs):
        rows = runs.get(slot, [])
        for start in range(0, max(len(rows), 1), tile):
            part = rows[start:start + tile]
            positions.extend(range(len(gather), len(gather) + len(part)))
            gather.extend(part + [part[0] if part else any_row] * (tile - len(part)))
            tile_slots.append(slot)
    padded = len(positions) != len(gather)
    gather_t = torch.tensor(gather, dtype=torch.long, device=device)
    pos_t = torch.tensor(positions, dtype=torch.long, device=device) if padded else None
    return LoRAStepPlan(row, tile, len(tile_slots), gather_t, (lo, hi) if direct else None,
                        None if direct else torch.tensor(tile_slots, dtype=torch.long, device=device), pos_t,
                        gather_t.index_select(0, pos_t) if padded else gather_t)


def add_lora_term(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
                  plan: LoRAStepPlan) -> torch.Tensor:
    """y [T, N] += the LoRA term of each adapter row of x [T, K]; ``a_slots`` [S, K, R], ``b_slots`` [S, R, N].

    Returns y (written in place)."""
    if x.shape[0] != plan.num_tokens:
        raise RuntimeError(f"LoRA: the step was planned for {plan.num_tokens} rows but a layer got {x.shape[0]}")
    if plan.slot_range is not None:
        a, b = a_slots[plan.slot_range[0]:plan.slot_range[1]], b_slots[plan.slot_range[0]:plan.slot_range[1]]
    else:
        a, b = a_slots.index_select(0, plan.tile_slots), b_slots.index_select(0, plan.tile_slots)
    xs = x.index_select(0, plan.gather).to(a.dtype).view(plan.num_tiles, plan.tile_rows, -1)
    delta = torch.bmm(torch.bmm(xs, a), b).view(plan.num_tiles * plan.tile_rows, -1)
    if plan.scatter_pos is not None:
        delta = delta.index_select(0, plan.scatter_pos)
    y.index_add_(0, plan.scatter_rows, delta.to(y.dtype))
    return y
