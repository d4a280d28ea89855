"""The grouped LoRA term of one step: every adapter's rows in one pair of batched matmuls (Punica's SGMV idea).

Per step, ``plan_step`` sorts the rows that carry an adapter by slot (base rows are left out: they get no term) and
cuts each slot's run into tiles of ``tile_rows`` rows. Every LoRA layer of the step then computes, with no Python
loop over adapters::

    xs = x[rows]                        [tiles * L, K]    (tile t: rows of one slot, padded up to L)
    h  = bmm(xs, A[slot of t])          [tiles, L, R]     A: [max_loras, K, R] slot buffer
    y[rows] += bmm(h, B[slot of t])     [tiles, L, N]     B: [max_loras, R, N], scaling folded in

The tile length trades padded rows (one long prefill beside short decodes) against per-tile weight copies; the
plan picks it per step from the run lengths, once for all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAStepPlan:
    """One step's rows by adapter slot, shared by every LoRA layer of the forward.

    ``gather`` [tiles * L] int64: the row of x behind each tile position (padding repeats a real row);
    ``tile_slots`` [tiles] int64: the slot of each tile; ``scatter_pos`` / ``scatter_rows``: the real positions
    of ``gather`` and their rows of y (None when no position is padding: then they are ``gather`` itself).
    """

    num_tokens: int
    tile_rows: int
    gather: torch.Tensor
    tile_slots: torch.Tensor
    scatter_pos: torch.Tensor | None
    scatter_rows: torch.Tensor


def choose_tile_rows(run_lengths: list[int], rank_width: int) -> int:
    """The tile length (a power of two) with the least cost: padded rows plus a tile's weight copy (about
    ``rank_width`` rows' worth each)."""
    longest = max(run_lengths)
    best, best_cost, length = 1, None, 1
    while True:
        tiles = sum(-(-n // length) for n in run_lengths)
        cost = tiles * length + tiles * rank_width
        if best_cost is None or cost < best_cost:
            best, best_cost = length, cost
        if length >= longest:
            return best
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
    tile = choose_tile_rows([len(r) for r in runs.values()], rank_width)
    gather: list[int] = []
    tile_slots: list[int] = []
    positions: list[int] = []
    for slot, rows in runs.items():
        for lo in range(0, len(rows), tile):
            part = rows[lo:lo + tile]
            positions.extend(range(len(gather), len(gather) + len(part)))
            gather.extend(part + [part[0]] * (tile - len(part)))
            tile_slots.append(slot)
    padded = len(positions) != len(gather)
    gather_t = torch.tensor(gather, dtype=torch.long, device=device)
    pos_t = torch.tensor(positions, dtype=torch.long, device=device) if padded else None
    return LoRAStepPlan(row, tile, gather_t, torch.tensor(tile_slots, dtype=torch.long, device=device), pos_t,
                        gather_t.index_select(0, pos_t) if padded else gather_t)


def add_lora_term(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
                  plan: LoRAStepPlan) -> torch.Tensor:
    """y [T, N] += the LoRA term of each adapter row of x [T, K]; ``a_slots`` [S, K, R], ``b_slots`` [S, R, N].

    Returns y (written in place)."""
    if x.shape[0] != plan.num_tokens:
        raise RuntimeError(f"LoRA: the step was planned for {plan.num_tokens} rows but a layer got {x.shape[0]}")
    xs = x.index_select(0, plan.gather).to(a_slots.dtype)
    tiles = plan.tile_slots.shape[0]
    h = torch.bmm(xs.view(tiles, plan.tile_rows, -1), a_slots.index_select(0, plan.tile_slots))
    delta = torch.bmm(h, b_slots.index_select(0, plan.tile_slots)).view(tiles * plan.tile_rows, -1)
    if plan.scatter_pos is not None:
        delta = delta.index_select(0, plan.scatter_pos)
    y.index_add_(0, plan.scatter_rows, delta.to(y.dtype))
    return y
