"""Which kernel each linear layer runs on this CPU, chosen by measurement (``kernels/autotune.py``).

The autotuner only chooses: each layer's weight (a ``BoundWeight``) builds the weight that runs the choice per
bucket of rows, and the layer binds it (``Linear.bind_weight``).

The candidates of a weight compute the same product within float rounding (each is tested against the others),
so a choice changes speed only:
- every ISA the kernels have for this CPU (AVX-512 where present, AVX2; ``PAGEDLLM_CPU_ISA`` forces one);
- for 4-bit weights, both panel layouts: ``dot8`` (activations split into two int8 terms, byte dot products:
  the fastest for few rows, where a step is bound by weight bytes) and ``pairs`` (float activations: faster for
  many rows on AVX2, where a step is compute-bound; figures in docs/performance.md). A layer whose buckets
  choose both keeps both copies (4-bit: ~1.2x the bytes); one that chooses one layout keeps only that one;
- for 8-bit weights on a CPU with AVX-512 VNNI, both layouts: ``panels`` (float activations) and ``dot4``
  (activations split into two int8 terms, VNNI byte dot products: bound by the weight's bytes, not by widening
  them: faster for the default model's tied Q8_0 LM head at one row; figures in docs/performance.md);
- for float32 weights, the C++ panels and BLAS on the plain rows; for bf16 weights, oneDNN's layout and the C++
  bf16 panels (``float_weights.py``, ``bf16_weights.py``). A mix keeps both copies.

Layers of one shape class (format, N, K, group) share one measurement; the table of choices is logged and saved
per machine fingerprint, so later starts only read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import autotune
from pagedllm.kernels.cpu import cpu_isa, kernels_name, sources_digest
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.quantization.bf16_weights import Bf16Weight
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight
from pagedllm.model_executor.layers.quantization.float_weights import Float32Panels
from pagedllm.model_executor.layers.quantization.packed_weight import PackedWeight
from pagedllm.model_executor.layers.quantization.qpanels import (
    AMX_ISA,
    AMX_LAYOUTS,
    PANEL,
    W8A8_ISAS,
    Int8Dot4Panels,
    Int8Panels,
    Q4Dot8Panels,
    Q4PairsPanels,
    QPanels,
    fp16_exact,
)
from pagedllm.platforms import platform_of
from pagedllm.utils import format_bytes

logger = init_logger(__name__)

ISA_NAMES = {1: "avx2", 2: "avx512", 3: "generic", AMX_ISA: "amx"}


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Panels [P, C, 16] -> rows [N, C] (the inverse of ``qpanels._panels``)."""
    p, c, _ = t.shape
    return t.transpose(1, 2).reshape(p * PANEL, c)[:n]


def other_layout(weight: QPanels) -> QPanels | None:
    """The same 4-bit weight in the other panel layout (dot8 <-> pairs), or None where there is none: dot8
    needs a group that is a multiple of 8 and keeps float16 scales and mins, so only exact ones convert."""
    if not isinstance(weight, Q4Dot8Panels | Q4PairsPanels):
        return None
    target = Q4PairsPanels if isinstance(weight, Q4Dot8Panels) else Q4Dot8Panels
    if target is Q4Dot8Panels and (weight.group % 8 or not (fp16_exact(weight.scales) and fp16_exact(weight.mins))):
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
                                            fp16_exact(weight.scales) and fp16_exact(weight.mins)):
        cache: list[QPanels | None] = []

        def alt() -> QPanels | None:
            if not cache:
                cache.append(other_layout(weight))
            return cache[0]

        layouts["pairs" if isinstance(weight, Q4Dot8Panels) else "dot8"] = alt
    vnni_only = set()
    if type(weight) is Int8Panels and weight.group % 4 == 0 and kernels.q8_dot_supported():
        layouts["dot4"] = lambda: Int8Dot4Panels.pack(_rows(weight.qweight, weight.out_features),
                                                      _rows(weight.scales, weight.out_features))
        vnni_only.add("dot4")
    isas = _isas(kernels)
    out: dict[str, Callable[[], tuple[PackedWeight, int]]] = {}
    for layout, make in layouts.items():
        # AMX tiles for the byte-dot-product layouts, timed like any other candidate (they win for many rows).
        amx = [AMX_ISA] if layout in AMX_LAYOUTS and not cpu_isa() and kernels.amx_dot_supported() else []
        for isa in isas + amx:
            if layout in vnni_only and isa not in W8A8_ISAS + (AMX_ISA,):
                continue
            out[f"{layout}/{ISA_NAMES[isa]}"] = lambda make=make, isa=isa: (make(), isa)
    return out


def shape_key(weight: PackedWeight) -> str:
    return f"{type(weight).__name__}:{weight.out_features}x{weight.in_features}:g{weight.group}"


@dataclass
class LayerTuning:
    """What the autotuner can do with one layer's weight: its shape class, its candidates (name -> a maker of the
    candidate's kernel, made only when timed or chosen) and how to build the weight that runs a choice per
    bucket."""

    key: str
    in_features: int
    kernels: dict[str, Callable[[], autotune.Kernel | None]]
    #: one choice per bucket -> (the weight bound to run them, the bytes of the second copy it keeps, if any)
    build: Callable[[list[str]], tuple[BoundWeight, int]]
    dtype: torch.dtype = torch.float32  # of the activations the candidates are timed on


def _quantized_tuning(weight: QPanels) -> LayerTuning | None:
    makers = candidates(weight)
    if len(makers) < 2:
        return None

    def kernel(name: str) -> autotune.Kernel | None:
        packed, isa = makers[name]()
        return packed.bind(isa) if packed is not None else None

    def build(choices: list[str]) -> tuple[BoundWeight, int]:
        made = {name: makers[name]() for name in dict.fromkeys(choices)}
        bound = {name: w.bind(isa) for name, (w, isa) in made.items()}
        primary = made[choices[0]][0]  # the layout few-row steps run stays the layer's weight
        primary.rebind(autotune.by_rows([bound[name] for name in choices]))
        copies = {id(w): w for w, _ in made.values()}
        return primary, sum(w.nbytes() for w in copies.values() if w is not primary)

    return LayerTuning(shape_key(weight), weight.in_features, {name: lambda n=name: kernel(n) for name in makers},
                       build)


def _float_tuning(weight: Float32Panels | Bf16Weight) -> LayerTuning | None:
    """A float weight's two kernels: float32 panels against BLAS on the plain rows (``blas``, MKL or oneDNN
    through ``torch.addmm``; Intel's libraries may win where the panels were not tuned), or a bf16 weight's oneDNN
    layout against the C++ bf16 panels (``panels``: AVX-512 BF16 dot products on a weight streamed in order,
    which win for few rows)."""
    makers = weight.candidates()
    if makers is None:
        return None

    def build(choices: list[str]) -> tuple[BoundWeight, int]:
        chosen = weight.with_choices(choices)
        return chosen, chosen.extra_copy_nbytes()

    dtype = torch.bfloat16 if isinstance(weight, Bf16Weight) else torch.float32
    return LayerTuning(weight.tuning_key(), weight.in_features, makers, build, dtype)


def release_tuning_state(model: nn.Module) -> None:
    """Drops what layers' weights kept only for the autotuner (the plain bf16 weights), tuned or not."""
    from pagedllm.model_executor.layers.linear import Linear

    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None:
            released = module.packed.without_tuning_state()
            if released is not module.packed:
                module.bind_weight(released)


def tuning_for(layer: nn.Module) -> LayerTuning | None:
    """The autotuner's plan for a linear layer (a ``Linear``) on the CPU, or None where it has one kernel only."""
    weight = layer.packed
    if isinstance(weight, QPanels):
        return _quantized_tuning(weight) if weight.cpu_matmul() is not None else None
    if isinstance(weight, Float32Panels | Bf16Weight):
        return _float_tuning(weight)
    return None


def autotune_model(model: nn.Module, mode: str, timer: Callable[..., float] = autotune.time_once) -> None:
    """Chooses, per shape class and bucket of rows, the kernel of every CPU linear layer of ``model`` that has
    more than one (``mode``: off | on (use the saved table, measure what it lacks) | force (measure again))."""
    from pagedllm.model_executor.layers.linear import Linear

    if mode not in autotune.MODES:
        raise ValueError(f"cpu_kernel_autotune: must be one of {list(autotune.MODES)}, got {mode!r}")
    if mode == "off":
        return
    groups: dict[str, list[tuple[Linear, LayerTuning]]] = {}
    for module in model.modules():
        plan = tuning_for(module) if isinstance(module, Linear) else None
        if plan is not None:
            groups.setdefault(plan.key, []).append((module, plan))
    if not groups:
        return
    table = autotune.AutotuneTable.open(autotune.fingerprint(f"{kernels_name()}-{sources_digest()}"))
    if table.stale:
        logger.info("cpu kernel autotune: the saved table was measured on another machine or build; measuring")

    def missing() -> list[str]:
        return [key for key, plans in groups.items()
                if mode == "force" or not _valid(table.choices(key), plans[0][1])]

    if missing():
        with autotune.measuring_lock(table):
            todo = missing()  # another process may have measured meanwhile
            for key in todo:
                plan = groups[key][0][1]
                made = {name: make() for name, make in plan.kernels.items()}
                timed = {name: kernel for name, kernel in made.items() if kernel is not None}
                choices, timings = autotune.choose(timed, plan.in_features, timer, dtype=plan.dtype)
                table.record(key, choices, timings)
            if todo:
                table.save()
    extra = 0
    for key, plans in groups.items():
        choices = table.choices(key)
        if not _valid(choices, plans[0][1]):
            continue  # a forced table without this shape: the default kernel stays
        for layer, plan in plans:
            weight, copy_nbytes = plan.build(choices)
            layer.bind_weight(weight)  # the layer rebinds: the autotuner only chose
            extra += copy_nbytes
        _log(key, choices, table.entries[key].get("ms", {}), len(plans))
    if extra:
        logger.info("cpu kernel autotune: layers keeping two copies of their weight (one per kernel) add %s",
                    format_bytes(extra))


def _valid(choices: list[str] | None, plan: LayerTuning) -> bool:
    return choices is not None and len(choices) == len(autotune.BUCKET_ROWS) and set(choices) <= set(plan.kernels)


def _log(key: str, choices: list[str], ms: dict[str, list[float]], num_layers: int) -> None:
    cells = []
    for b, rows in enumerate(autotune.BUCKET_ROWS):
        name = choices[b]
        others = [f"{n} {t[b]:.3f}" for n, t in ms.items() if n != name and b < len(t)]
        mine = f" {ms[name][b]:.3f} ms" if name in ms and b < len(ms[name]) else ""
        cells.append(f"M~{rows}: {name}{mine}" + (f" (vs {', '.join(others)})" if others else ""))
    logger.info("cpu kernel autotune %s (%d layers): %s", key, num_layers, "; ".join(cells))
