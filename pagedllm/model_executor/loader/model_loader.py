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
    tensor by tensor; a CTranslate2 Whisper ``model.bin`` is read by ``loader/ct2_whisper.py``.
    """
    from pagedllm.model_executor.layers.direct_call import promote_attributes
    from pagedllm.model_executor.layers.quantization import get_quantization_config
    from pagedllm.model_executor.layers.quantization.base import to_empty_keeping_loaders
    from pagedllm.model_executor.models.registry import get_model_cls

    if not mc.model_path:
        from pagedllm.model_executor.loader.model_config import resolve_model_config

        resolve_model_config(mc)
    device = torch.device(device)
    dtype = torch_dtype(mc.dtype)
    start = time.perf_counter()
    if mc.model_impl == "transformers":
        return _load_transformers_fallback(mc, device, dtype, start)
    model_cls = get_model_cls([mc.architecture])
    quant_config = get_quantization_config(mc.quantization, mc.hf_config, mc.gguf_file)
    if quant_config is not None:
        quant_config.check_dtype(dtype, device)
    # Build on the meta device so no time goes into random init, then allocate real storage once.
    with torch.device("meta"):
        model = model_cls(mc.hf_config, dtype, quant_config) if quant_config else model_cls(mc.hf_config, dtype)
    model = to_empty_keeping_loaders(model, device)

    if mc.gguf_file:
        from pagedllm.model_executor.loader.gguf_file import GGUFFile
        from pagedllm.model_executor.loader.gguf_llama import iter_gguf_weights

        gguf = GGUFFile(mc.gguf_file)
        keep = quant_config is not None and quant_config.name == "gguf"
        weights = iter_gguf_weights(gguf, mc.hf_config, keep_quantized=keep)
        total = len(gguf.tensors)
    elif mc.ct2_file:
        from pagedllm.model_executor.loader.ct2_file import read_ct2_file
        from pagedllm.model_executor.loader.ct2_whisper import count_ct2_whisper_weights, iter_ct2_whisper_weights

        weights = iter_ct2_whisper_weights(read_ct2_file(mc.ct2_file), mc.hf_config)
        total = count_ct2_whisper_weights(mc.hf_config)
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
    # Each layer repacks its weights for the kernels (fp32 panels, quantized panels), now.
    for module in list(model.modules()):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    from pagedllm.model_executor.layers.quantization.kernel_choice import autotune_model, release_tuning_state

    autotune_model(model, mc.cpu_kernel_autotune)  # CPU linear layers: the kernel measured fastest here
    release_tuning_state(model)
    promote_attributes(model)  # the weights are final: plain attribute reads from here on (direct_call.py)
    logger.info("loaded %s (%s, %s%s) in %.2f s; weights use %s on %s", mc.architecture, mc.model_path, mc.dtype,
                f", quantization {quant_config.name}" if quant_config else "", time.perf_counter() - start,
                format_bytes(model_weight_bytes(model)), device)
    for scheme, (count, nbytes) in sorted(weight_bytes_by_scheme(model).items()):
        logger.info("  %-28s %4d tensors/layers  %s", scheme, count, format_bytes(nbytes))
    return model


def _load_transformers_fallback(mc: ModelConfig, device: torch.device, dtype: torch.dtype, start: float) -> nn.Module:
    """The transformers class for ``mc.architecture``, weights from the folder's safetensors, attention on
    pagedllm's paged backends (``models/transformers_fallback``)."""
    from pagedllm.model_executor.loader.safetensors_weights import (
        count_safetensors,
        iter_safetensors,
        safetensors_files,
    )
    from pagedllm.model_executor.models.transformers_fallback.build import build_transformers_model
    from pagedllm.model_executor.models.transformers_fallback.support import transformers_model_class

    cls = transformers_model_class(mc.hf_config, mc.architecture, mc.trust_remote_code)
    files = safetensors_files(mc.model_path)
    weights = _with_progress(iter_safetensors(files), count_safetensors(files), "Loading weights")
    model = build_transformers_model(cls, mc.hf_config, mc.architecture, dtype, device, weights,
                                     encoder=mc.is_encoder_only)
    layers = list(model.attn_layers)
    windows = sorted({m.spec.window for m in layers if m.spec.window})
    logger.info("loaded %s (%s, %s) through the transformers fallback (%s with pagedllm's paged attention: %d "
                "layers, %d KV heads of %d%s) in %.2f s; weights use %s on %s; a native implementation would be "
                "faster (docs/models.md)", mc.architecture, mc.model_path, mc.dtype, type(model.hf_model).__name__,
                len(layers), layers[0].num_kv_heads, layers[0].head_size,
                f", sliding windows {windows}" if windows else "", time.perf_counter() - start,
                format_bytes(model_weight_bytes(model)), device)
    return model


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds now (parameters, buffers, packed and quantized copies)."""
    return sum(nbytes for _, nbytes in weight_bytes_by_scheme(model).values())


def weight_bytes_by_scheme(model: nn.Module) -> dict[str, tuple[int, int]]:
    """scheme ("unquantized float32", "int8 per-channel", "gguf Q4_1", ...) -> (layers or tensors, bytes).

    Linear layers report their method's scheme; every other parameter or buffer counts as "other <dtype>".
    """
    from pagedllm.model_executor.layers.linear import Linear

    out: dict[str, tuple[int, int]] = {}

    def add(scheme: str, nbytes: int) -> None:
        count, total = out.get(scheme, (0, 0))
        out[scheme] = (count + 1, total + nbytes)

    inside_linear: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            add(module.quant_method.scheme(module), module.weight_nbytes())
            inside_linear.update(id(t) for t in [*module.parameters(), *module.buffers()])
        elif hasattr(module, "experts_weight_nbytes"):  # a MoE layer's stacked experts (layers/fused_moe)
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if module.experts_weight_nbytes():
                add(f"moe experts {module.describe()}", module.experts_weight_nbytes())
            inside_linear.update(id(t) for t in own)
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in inside_linear:
            add(f"other {str(t.dtype).removeprefix('torch.')}", t.numel() * t.element_size())
    return out
