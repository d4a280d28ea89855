"""Multimodal rotary positions (M-RoPE, Qwen2-VL): each token has three positions (temporal, height, width); the
rotary's frequency pairs are split into ``mrope_section`` runs, the first run rotated by the temporal position,
the next by the height, the last by the width. Text tokens have three equal positions (plain RoPE); an image's
tokens count over its grid of merged patches, and the text after it continues from the largest position + 1.

    prompt positions: ``prompt_positions`` (from the images' spans and grids) -> [3, L] and the decode delta
    a step: ``MRopeLlamaModel.rope_step(positions [3, T])`` -> this step's own cos/sin table (row i: token i's),
            read by the shared rotary path (C++ / Triton kernels, or torch) as any table, with positions 0..T-1
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.model_executor.layers.rotary_embedding import RopeStep, RotaryEmbedding
from pagedllm.model_executor.models.llama import LlamaModel


def prompt_positions(num_tokens: int, images: list[tuple[int, int, int, int]]) -> tuple[np.ndarray, int]:
    """``images``: (first token, t, h, w) of each image's token run, in prompt order, the grid in merged patches
    (t * h * w tokens) -> (positions [3, num_tokens] int64, delta): a token at index i >= num_tokens has position
    i + delta on all three axes (transformers' ``rope_deltas``: the prompt's largest position + 1 - its length)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor, pos = 0, 0  # next token index, next text position
    for offset, t, h, w in sorted(images):
        if offset < cursor or offset + t * h * w > num_tokens:
            raise ValueError(f"image tokens at {offset}..{offset + t * h * w} do not fit the prompt's "
                             f"{num_tokens} tokens in order")
        out[:, cursor:offset] = np.arange(pos, pos + offset - cursor)
        pos += offset - cursor
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        out[:, offset:offset + t * h * w] = grid + pos
        cursor = offset + t * h * w
        pos += max(h, w)  # transformers' rule for images (t = 1): the next text starts past the larger side
    out[:, cursor:] = np.arange(pos, pos + num_tokens - cursor)
    delta = (int(out.max()) + 1 - num_tokens) if num_tokens else 0
    return out, delta


class _StepTable:
    """A rotary table whose row i is token i's cos/sin this step: what ``RopeStep`` reads of an embedding."""

    def __init__(self, emb: RotaryEmbedding, table: torch.Tensor) -> None:
        self.head_dim = emb.head_dim
        self.rotary_kernels = emb.rotary_kernels  # bound for the table's dtype, which this table shares
        self._table = table

    def table_rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def table_on(self, device: torch.device) -> torch.Tensor:
        return self._table

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def mrope_step(emb: RotaryEmbedding, positions: torch.Tensor, section: list[int]) -> RopeStep:
    """positions [3, T] -> a ``RopeStep`` over a [T, D] table: column j of each half (cos | sin) comes from the
    row of the axis whose ``section`` run holds frequency j."""
    table = emb.table_on(positions.device)  # [P, D]
    half = table.shape[1] // 2
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} does not add up to the rotary's {half} frequencies")
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section)).repeat(2).to(positions.device)  # [D]
    rows = table[positions]  # [3, T, D]
    step_table = rows.gather(0, axis.view(1, 1, -1).expand(1, rows.shape[1], -1)).squeeze(0).contiguous()
    t = positions.shape[1]
    return RopeStep(_StepTable(emb, step_table), torch.arange(t, device=positions.device))  # type: ignore[arg-type]


class MRopeLlamaModel(LlamaModel):
    """A Llama-shaped decoder (Qwen2's) whose steps take [3, T] positions (or [T]: three equal rows, plain RoPE)."""

    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        self.mrope_section = [int(s) for s in params.get("mrope_section") or ()]
        if len(self.mrope_section) != 3:
            raise ValueError(f"M-RoPE: rope mrope_section {self.mrope_section} needs three runs")

    def rope_step(self, positions: torch.Tensor) -> RopeStep:
        if positions.dim() == 1:
            return super().rope_step(positions)
        return mrope_step(self.rotary_emb, positions, self.mrope_section)
