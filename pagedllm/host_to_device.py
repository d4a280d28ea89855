"""Host data (lists, NumPy arrays, CPU tensors) to device tensors without a stream sync.

A blocking host-to-device copy (``torch.tensor(values, device="cuda")``, ``t.to("cuda")``) makes torch
synchronize the stream after the copy: the host waits for every kernel queued before it, so it cannot prepare
a step's sampling inputs while the GPU runs the forward pass. From pinned (page-locked) memory the copy is
queued like a kernel instead, and torch's pinned-memory cache keeps the host buffer alive and unused until
the copy has run. Off CUDA both helpers are plain ``.to(device)``.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.platforms import platform_for


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor goes to CUDA through pinned memory, queued without a sync."""
    device = torch.device(device)
    return platform_for(device).to_device(t, device)


def tensor_on(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, queued without a sync on CUDA."""
    device = torch.device(device)
    return platform_for(device).tensor_on(values, dtype, device)


def index_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] ([len(rows), ...]): a view when ``rows`` are the leading rows in order (a decode-only step),
    else a gather whose index reaches a GPU without a stream sync (indexing with a list would copy it to the
    device blocking)."""
    if rows == list(range(len(rows))):
        return t[:len(rows)]
    return t.index_select(0, tensor_on(rows, torch.long, t.device))
