"""Which kernel each quantized linear layer runs on this CPU, chosen by measurement (``kernels/autotune.py``).

The candidates of a weight compute the same product within float rounding (each is tested against the others),
so a choice changes speed only:
- every ISA the kernels have for this CPU (AVX-512 where present, AVX2; ``PAGEDLLM_CPU_ISA`` forces one);
- for 4-bit weights, both panel layouts: ``dot8`` (activations split into two int8 terms, byte dot products:
  the fastest for few rows, where a step is bound by weight bytes) and ``pairs`` (float activations: measured
  2x faster than dot8 for 64+ rows on an AVX2 EPYC, where a step is compute-bound). A layer whose buckets
  choose both keeps both copies (4-bit: ~1.2x the bytes); one that chooses one layout keeps only that one.

Layers of one shape class (format, N, K, group) share one measurement; the table of choices is logged and saved
per machine fingerprint, so later starts only read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import autotune
from pagedllm.kernels.cpu import cpu_isa, kernels_name, sources_digest
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.quantization.packed_weight import PackedWeight
from pagedllm.model_executor.layers.quantization.qpanels import PANEL, Q4Dot8Panels, Q4PairsPanels, QPanels
from pagedllm.platforms import platform_of
from pagedllm.utils import format_bytes

logger = init_logger(__name__)

ISA_NAMES = {1: "avx2", 2: "avx512", 3: "generic"}


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Panels [P, C, 16] -> rows [N, C] (the inverse of ``qpanels._panels``)."""
    p, c, _ = t.shape
    return t.transpose(1, 2).reshape(p * PANEL, c)[:n]


def _fp16_exact(t: torch.Tensor) -> bool:
    return bool((t.half().float() == t.float()).all())


def other_layout(weight: QPanels) -> QPanels | None:
    """The same 4-bit weight in the other panel layout (dot8 <-> pairs), or None where there is none: dot8
    needs a group that is a multiple of 8 and keeps float16 scales and mins, so only exact ones convert."""
    if not isinstance(weight, Q4Dot8Panels | Q4PairsPanels):
        return None
    target = Q4PairsPanels if isinstance(weight, Q4Dot8Panels) else Q4Dot8Panels
    if target is Q4Dot8Panels and (weight.group % 8 or not (_fp16_exact(weight.scales) and _fp16_exact(weight.mins))):
        return None
    n = weight.out_features
    q = _rows(weight._levels(), n).to(torch.uint8)
    return target.pack(q, _rows(weight.scales.float(), n), _rows(weight.mins.float(), n))


def _isas(kernels: Any) -> list[int]:
    forced = cpu_isa()
    if forced:
        return [forced]
    fast = [isa for isa in kernels.supported_isas() if isa != 3]
    return fast or [3]


def candidates(weight: PackedWeight) -> dict[str, Callable[[], tuple[PackedWeight, int]]]:
    """name ("dot8/avx2", ...) -> a maker of (the weight in that candidate's layout, its ISA code)."""
    if not isinstance(weight, QPanels):
        return {}
    kernels = platform_of(weight.qweight).cpu_kernels(torch.float32)
    if kernels is None:
        return {}
    layouts: dict[str, Callable[[], PackedWeight | None]] = {weight.layout: lambda: weight}
    if isinstance(weight, Q4Dot8Panels) or (isinstance(weight, Q4PairsPanels) and weight.group % 8 == 0 and
                                            _fp16_exact(weight.scales) and _fp16_exact(weight.mins)):
        cache: list[QPanels | None] = []

        def alt() -> QPanels | None:
            if not cache:
                cache.append(other_layout(weight))
            return cache[0]

        layouts["pairs" if isinstance(weight, Q4Dot8Panels) else "dot8"] = alt
    out: dict[str, Callable[[], tuple[PackedWeight, int]]] = {}
    for layout, make in layouts.items():
        for isa in _isas(kernels):
            out[f"{layout}/{ISA_NAMES[isa]}"] = lambda make=make, isa=isa: (make(), isa)
    return out


def shape_key(weight: PackedWeight) -> str:
    return f"{type(weight).__name__}:{weight.out_features}x{weight.in_features}:g{weight.group}"


def autotune_model(model: nn.Module, mode: str, timer: Callable[..., float] = autotune.time_once) -> None:
    """Chooses, per shape class and bucket of rows, the kernel of every quantized CPU linear layer of ``model``
    (``mode``: off | on (use the saved table, measure what it lacks) | force (measure everything again))."""
    from pagedllm.model_executor.layers.linear import Linear

    if mode not in autotune.MODES:
        raise ValueError(f"cpu_kernel_autotune: must be one of {list(autotune.MODES)}, got {mode!r}")
    if mode == "off":
        return
    groups: dict[str, list[Linear]] = {}
    for module in model.modules():
        weight = getattr(module, "qpanels", None)
        if isinstance(module, Linear) and isinstance(weight, QPanels) and len(candidates(weight)) > 1:
            groups.setdefault(shape_key(weight), []).append(module)
    if not groups:
        return
    table = autotune.AutotuneTable.open(autotune.fingerprint(f"{kernels_name()}-{sources_digest()}"))
    if table.stale:
        logger.info("cpu kernel autotune: the saved table was measured on another machine or build; measuring")
    todo = [key for key in groups if mode == "force" or not _valid(table.choices(key), groups[key][0])]
    if todo:
        with autotune.measuring_lock(table):
            todo = [key for key in todo if mode == "force" or not _valid(table.choices(key), groups[key][0])]
            for key in todo:
                weight = groups[key][0].qpanels
                made = {name: make() for name, make in candidates(weight).items()}
                timed = {name: w.bind(isa) for name, (w, isa) in made.items() if w is not None}
                choices, timings = autotune.choose(timed, weight.in_features, timer)
                table.record(key, choices, timings)
            if todo:
                table.save()
    extra = 0
    for key, layers in groups.items():
        choices = table.choices(key)
        if not _valid(choices, layers[0]):
            continue  # a forced table without this shape: the default kernel stays
        for layer in layers:
            extra += _apply(layer, choices)
        _log(key, choices, table.entries[key].get("ms", {}), len(layers))
    if extra:
        logger.info("cpu kernel autotune: layers keeping both 4-bit layouts add %s", format_bytes(extra))


def _valid(choices: list[str] | None, layer: nn.Module) -> bool:
    return choices is not None and len(choices) == len(autotune.BUCKET_ROWS) and set(choices) <= set(
        candidates(layer.qpanels))


def _apply(layer: nn.Module, choices: list[str]) -> int:
    """Binds the layer's kernel per bucket; returns the bytes an extra layout copy costs."""
    makers = candidates(layer.qpanels)
    made = {name: makers[name]() for name in dict.fromkeys(choices)}
    weights = {id(w): w for w, _ in made.values()}
    bound = {name: w.bind(isa) for name, (w, isa) in made.items()}
    kernel = autotune.by_rows([bound[name] for name in choices])
    primary = made[choices[0]][0]  # the layout few-row steps run, kept as the layer's weight
    object.__setattr__(primary, "_kernel", kernel)
    layer.qpanels = primary
    layer._cpu_matmul = primary.cpu_matmul()
    return sum(w.nbytes() for w in weights.values() if w is not primary)


def _log(key: str, choices: list[str], ms: dict[str, list[float]], num_layers: int) -> None:
    cells = []
    for b, rows in enumerate(autotune.BUCKET_ROWS):
        name = choices[b]
        others = [f"{n} {t[b]:.3f}" for n, t in ms.items() if n != name and b < len(t)]
        mine = f" {ms[name][b]:.3f} ms" if name in ms and b < len(ms[name]) else ""
        cells.append(f"M~{rows}: {name}{mine}" + (f" (vs {', '.join(others)})" if others else ""))
    logger.info("cpu kernel autotune %s (%d layers): %s", key, num_layers, "; ".join(cells))
