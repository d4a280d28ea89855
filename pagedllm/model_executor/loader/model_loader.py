"""``load_model``: build the model class for a resolved ModelConfig and fill it with its weights."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from pagedllm.config import ModelConfig
from pagedllm.logger import init_logger
from pagedllm.model_executor.loader.dtype import torch_dtype
from pagedllm.utils import format_bytes

logger = init_logger(__name__)


def _with_progress(weights: Iterable[tuple[str, torch.Tensor]], total: int,
                   desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield from tqdm(weights, total=total, desc=desc, unit="tensor", leave=False, dynamic_ncols=True)


def load_model(mc: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The model for ``mc`` on ``device``, weights in ``mc.dtype``, eval mode, gradients off.

    Resolves ``mc`` first if needed. HF folders load from safetensors shards; GGUF files are dequantized
    tensor by tensor.
    """
    from pagedllm.model_executor.layers.linear import pack_linear_weights
    from pagedllm.model_executor.models.registry import get_model_cls

    if not mc.model_path:
        from pagedllm.model_executor.loader.model_config import resolve_model_config

        resolve_model_config(mc)
    device = torch.device(device)
    dtype = torch_dtype(mc.dtype)
    start = time.perf_counter()
    model_cls = get_model_cls([mc.architecture])
    # Build on the meta device so no time goes into random init, then allocate real storage once.
    with torch.device("meta"):
        model = model_cls(mc.hf_config, dtype)
    model = model.to_empty(device=device)

    if mc.gguf_file:
        from pagedllm.model_executor.loader.gguf_file import GGUFFile
        from pagedllm.model_executor.loader.gguf_llama import iter_gguf_weights

        gguf = GGUFFile(mc.gguf_file)
        weights = iter_gguf_weights(gguf, mc.hf_config)
        total = len(gguf.tensors)
    else:
        from pagedllm.model_executor.loader.safetensors_weights import (
            count_safetensors,
            iter_safetensors,
            safetensors_files,
        )

        files = safetensors_files(mc.model_path)
        weights = iter_safetensors(files)
        total = count_safetensors(files)
    model.load_weights(_with_progress(weights, total, "Loading weights"))
    model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # On CPUs the matmul kernel reads weights in its own panel order: repack once, now.
    packed = pack_linear_weights(model)
    logger.info("loaded %s (%s, %s) in %.2f s; weights use %s on %s%s", mc.architecture, mc.model_path,
                mc.dtype, time.perf_counter() - start, format_bytes(weight_bytes), device,
                f" ({packed} layers packed for the CPU matmul kernel)" if packed else "")
    return model
