"""Iterate the tensors of an HF folder's ``*.safetensors`` shards."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch


def safetensors_files(folder: str) -> list[str]:
    """Shard paths, from ``model.safetensors.index.json`` when present (ignores stray extra files)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder}")
    return files


def count_safetensors(files: list[str]) -> int:
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    return total


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from each shard in turn; tensors are memory-mapped until copied."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
