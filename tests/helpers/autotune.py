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


def dense_for_many_rows(model: torch.nn.Module) -> dict:
    """A forced autotune table (``PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE``'s JSON) that runs every quantized linear
    layer of ``model`` on its packing's own kernel up to 32 rows and on its dense copy (dense_copy.py) from 33."""
    from pagedllm.model_executor.layers.quantization import kernel_choice

    entries = {}
    for layer in model.modules():
        if isinstance(getattr(layer, "packed", None), kernel_choice.QPanels):
            plan = kernel_choice.tuning_for(layer)
            names = list(plan.kernels)
            dense = next(n for n in names if n.startswith("dense-"))
            entries[plan.key] = {"choices": [names[0]] * 3 + [dense] * 2}
    return {"entries": entries}


def words_from_three_rows(model: torch.nn.Module) -> dict:
    """A forced autotune table that runs every dot8 / dot4 capable layer of ``model`` (the LM head included) on its
    packing's own kernel for 1-2 rows and on its words tiles (kernels/csrc/words_gemm.h) from 3 rows on."""
    from pagedllm.model_executor.layers.quantization import kernel_choice

    entries = {}
    for layer in model.modules():
        if isinstance(getattr(layer, "packed", None), kernel_choice.QPanels):
            plan = kernel_choice.tuning_for(layer)
            names = list(plan.kernels)
            words = [n for n in names if "/words-" in n]
            if words:
                entries[plan.key] = {"choices": [names[0]] + [words[-1]] * 4}
    return {"entries": entries}
