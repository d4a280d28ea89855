"""``--num-lora-adapters N --lora-rank R`` for the offline benchmarks: requests spread over N random adapters.

The adapters are PEFT folders written to a temporary directory (random A and B on every attention and MLP
projection of the base model, rank R), so a run needs nothing but the base model; request i uses adapter
``i % N``. The engine gets ``--enable-lora`` and ``--max-lora-rank`` at least R; ``--max-loras`` (adapters in one
batch) stays the caller's choice, as in vLLM's benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from typing import Any

import torch

from pagedllm.engine_args import EngineArgs
from pagedllm.lora.request import LoRARequest


def add_lora_bench_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    group.add_argument("--num-lora-adapters", type=int, default=0,
                       help="Spread the requests over this many random LoRA adapters on every projection "
                            "(0: the base model alone). Set --max-loras for the adapters one batch may mix.")
    group.add_argument("--lora-rank", type=int, default=16, help="Rank of the random adapters (default: 16).")


def with_lora(engine_args: EngineArgs, args: argparse.Namespace) -> EngineArgs:
    """The engine arguments a run over random adapters needs (unchanged without them)."""
    if getattr(args, "num_lora_adapters", 0) <= 0:
        return engine_args
    return dataclasses.replace(engine_args, enable_lora=True,
                               max_lora_rank=max(engine_args.max_lora_rank, args.lora_rank))


def random_adapters(hf_config: Any, num_adapters: int, rank: int, seed: int = 0,
                    root: str | None = None) -> list[LoRARequest]:
    """``num_adapters`` random PEFT LoRA folders for a base model of ``hf_config`` (in ``root``, else a temporary
    folder), as LoRARequests."""
    from safetensors.torch import save_file

    from pagedllm.lora.target_modules import base_module_shapes

    if num_adapters < 1 or rank < 1:
        raise ValueError("num_lora_adapters and lora_rank must be positive")
    root = root or tempfile.mkdtemp(prefix="pagedllm-lora-bench-")
    shapes = base_module_shapes(hf_config)
    leaves = sorted({module.rsplit(".", 1)[1] for module in shapes})
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(num_adapters):
        path = os.path.join(root, f"adapter-{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for module, (out_features, in_features) in shapes.items():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.01
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as fh:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": leaves,
                       "bias": "none", "task_type": "CAUSAL_LM"}, fh)
        requests.append(LoRARequest(f"bench-{i}", i + 1, path))
    return requests


def spread(adapters: list[LoRARequest], num_requests: int) -> list[LoRARequest] | None:
    """Request i's adapter (``i % len(adapters)``), or None without adapters."""
    return [adapters[i % len(adapters)] for i in range(num_requests)] if adapters else None
