"""What the kernel-autotuner tests share: a cache folder of the test's own (no table from another run or machine)
and a model that is only a list of linear layers, for ``kernel_choice.autotune_model``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def use_own_autotune_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotuner reads and saves its table under ``tmp_path`` only."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE", raising=False)


class LayersModel(torch.nn.Module):
    """A model holding ``layers`` and nothing else."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
