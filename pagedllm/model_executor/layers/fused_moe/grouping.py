"""Tokens grouped by expert: the (token, slot) pairs of a step sorted once per layer by expert id, so each expert
multiplies one contiguous run of rows by its own weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertGroups:
    """One layer's assignment of T tokens x k slots, sorted by expert (R = T * k rows).

    ``token_of``: [R] int64, the token each sorted row reads and writes back to.
    ``weight``: [R, 1] float32, the router weight of each sorted row.
    ``ends``: [E] int32, the end of each expert's run in the sorted rows (expert e owns ``ends[e-1]:ends[e]``).
    ``order``: [T * k] int64, the (token * k + slot) each sorted row came from, over all the rows (also those
    ``first_experts`` leaves out); None where the grouping was made elsewhere (the C++ routing).
    """

    token_of: torch.Tensor
    weight: torch.Tensor
    ends: torch.Tensor
    order: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.token_of.numel()

    def first_experts(self, n: int) -> ExpertGroups:
        """The rows of experts [0, n) only (expert parallelism: the bucket past them holds other ranks' experts)."""
        rows = int(self.ends[n - 1]) if n else 0
        return ExpertGroups(self.token_of[:rows], self.weight[:rows], self.ends[:n], self.order)

    def slot_rows(self) -> torch.Tensor:
        """[T * k] int64: the sorted row each (token, slot) became (the inverse of ``order``); a row at or past
        ``num_rows`` belongs to experts ``first_experts`` left out."""
        assert self.order is not None, "slot_rows needs the grouping's order"
        rows = torch.empty_like(self.order)
        rows[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return rows


def group_by_expert(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """weights [T, k] float32, ids [T, k] int64 (``routing.select_experts``) -> the rows sorted by expert.

    The sort is stable, so within an expert the rows keep token order (results do not depend on the batch's
    other tokens)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # Not bincount: on CUDA it reads the largest id back to the host, which a CUDA graph cannot record.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    return ExpertGroups(token_of=order // ids.shape[1], weight=weights.reshape(-1)[order].unsqueeze(1), ends=ends,
                        order=order)
