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
- for the byte-dot layouts (``dot8``, ``dot4``), their "words" tiles on each ISA (``dot8/words-avx512``: the
  panels widened to int16 pairs once per block of rows, x as one int16 term: one product per 2 k where the byte
  tiles take two per 4 k; faster for many rows, kernels/csrc/words_gemm.h). ``dot4`` is offered for them on CPUs
  without VNNI too;
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
from pagedllm.model_executor.layers.quantization.dense_copy import (
    DENSE_FIRST_BUCKET,
    PREFIX,
    DenseCopy,
    dense_candidates,
    dense_copies_allowed,
    dense_nbytes,
    is_dense,
)
from pagedllm.model_executor.layers.quantization.float_weights import Float32Panels
from pagedllm.model_executor.layers.quantization.packed_weight import PackedWeight
from pagedllm.model_executor.layers.quantization.qpanels import (
    AMX_ISA,
    AMX_LAYOUTS,
    PANEL,
    W8A8_ISAS,
    WORDS,
    WORDS_MAX_GROUP,
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


def candidates(weight: PackedWeight, dense: bool = True, exact_output: bool = False
               ) -> dict[str, Callable[[], tuple[PackedWeight | DenseCopy, int]]]:
    """name ("dot8/avx2", ...) -> a maker of (the weight in that candidate's layout, its ISA code); with
    ``dense``, the dense copies too (``dense_copy.py``: "dense-bf16/onednn", ...), for many rows;
    ``exact_output``: only float32 ones (the LM head)."""
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
    vnni = kernels.q8_dot_supported()
    if type(weight) is Int8Panels and weight.group % 4 == 0 and (vnni or weight.group <= WORDS_MAX_GROUP["dot4"]):
        layouts["dot4"] = lambda: Int8Dot4Panels.pack(_rows(weight.qweight, weight.out_features),
                                                      _rows(weight.scales, weight.out_features))
    isas = _isas(kernels)
    out: dict[str, Callable[[], tuple[PackedWeight, int]]] = {}
    for layout, make in layouts.items():
        # AMX tiles for the byte-dot-product layouts, timed like any other candidate (they win for many rows).
        amx = [AMX_ISA] if layout in AMX_LAYOUTS and not cpu_isa() and kernels.amx_dot_supported() else []
        for isa in isas + amx:
            if layout == "dot4" and type(weight) is Int8Panels and (not vnni or isa not in W8A8_ISAS + (AMX_ISA,)):
                continue  # the byte tiles of 8-bit levels need VNNI
            out[f"{layout}/{ISA_NAMES[isa]}"] = lambda make=make, isa=isa: (make(), isa)
        if layout in WORDS_MAX_GROUP and weight.group <= WORDS_MAX_GROUP[layout]:
            for isa in isas:
                out[f"{layout}/words-{ISA_NAMES[isa]}"] = lambda make=make, isa=isa: (make(), isa | WORDS)
    if dense:
        for name, make_copy in dense_candidates(weight, exact_output).items():
            out[name] = lambda make_copy=make_copy: (make_copy(), 0)
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
    #: The first bucket of rows a dense copy may be chosen for (``dense_copy.DENSE_FIRST_BUCKET``; 0 for the LM
    #: head, which runs outside CPU step graphs).
    dense_first_bucket: int = DENSE_FIRST_BUCKET


def _quantized_tuning(weight: QPanels, dense: bool = True, exact_output: bool = False) -> LayerTuning | None:
    makers = candidates(weight, dense, exact_output)
    if len(makers) < 2:
        return None

    def kernel(name: str) -> autotune.Kernel | None:
        packed, isa = makers[name]()
        return packed.bind(isa) if packed is not None else None

    def build(choices: list[str]) -> tuple[BoundWeight, int]:
        made = {name: makers[name]() for name in dict.fromkeys(choices)}
        bound = {name: w.bind(isa) for name, (w, isa) in made.items()}
        # The quantized layout few-row steps run stays the layer's weight (the packed one where every bucket
        # chose a dense copy: it stays the form the layer reports, and its reference).
        packed = [w for w, _ in made.values() if isinstance(w, PackedWeight)]
        primary = packed[0] if packed else weight
        primary.rebind(autotune.by_rows([bound[name] for name in choices]))
        copies = {id(w): w for w, _ in made.values()}
        return primary, sum(w.nbytes() for w in copies.values() if w is not primary)

    # bf16 copies are another set of candidates: their own entry in the table
    key = shape_key(weight) + (":bf16-copies" if any(n.startswith(f"{PREFIX}bf16") for n in makers) else "")
    return LayerTuning(key, weight.in_features, {name: lambda n=name: kernel(n) for name in makers}, build)


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


def tuning_for(layer: nn.Module, dense: bool = True) -> LayerTuning | None:
    """The autotuner's plan for a linear layer (a ``Linear``) on the CPU, or None where it has one kernel only;
    ``dense``: a quantized weight's dense copies are candidates too."""
    weight = layer.packed
    if isinstance(weight, QPanels):
        if weight.cpu_matmul() is None:
            return None
        head = is_lm_head(layer)
        tuning = _quantized_tuning(weight, dense, exact_output=head)
        if tuning is not None and head:
            tuning.key += ":head"  # its candidates differ from a hidden layer's of the same shape
            tuning.dense_first_bucket = 0  # logits are computed outside the step graphs: every bucket may
        return tuning
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
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    dense, why_not = dense_copies_allowed(sum(dense_nbytes(layer.packed) for layer in linears
                                              if isinstance(layer.packed, QPanels)))
    if why_not and any(isinstance(layer.packed, QPanels) for layer in linears):
        logger.info("cpu kernel autotune: no dense copies of quantized weights for many rows: %s", why_not)
    groups: dict[str, list[tuple[Linear, LayerTuning]]] = {}
    for module in linears:
        plan = tuning_for(module, dense)
        if plan is not None:
            groups.setdefault(plan.key, []).append((module, plan))
    if not groups:
        return
    table = autotune.AutotuneTable.open(autotune.fingerprint(f"{kernels_name()}-{sources_digest()}"))
    if table.stale:
        logger.info("cpu kernel autotune: the saved table was measured on another machine or build; measuring")
    # Entries measured on a busy machine (or still disagreeing with their neighbours) are measured again once a
    # start finds the machine quiet.
    stale = [key for key in groups if table.needs_refresh(key)] if mode == "on" and not table.read_only else []
    quiet = bool(stale) and autotune.load_now() < autotune.BUSY_LOAD
    if stale:
        logger.info("cpu kernel autotune: %d entries were measured on a busy machine or disagree with their "
                    "neighbours; %s", len(stale), "measuring them again" if quiet else "the machine is still busy: "
                    "kept until a quieter start")

    def missing() -> list[str]:
        return [key for key, plans in groups.items()
                if mode == "force" or not _valid(table.choices(key), plans[0][1])
                or (quiet and table.needs_refresh(key))]

    if missing():
        with autotune.measuring_lock(table):
            todo = missing()  # another process may have measured meanwhile
            for key in todo:
                plan = groups[key][0][1]
                made = {name: make() for name, make in plan.kernels.items()}
                timed = {name: kernel for name, kernel in made.items() if kernel is not None}
                before = autotune.cpu_snapshot()
                # Dense copies only for many rows: smaller batches run in CPU step graphs, which their torch
                # ops would end (dense_copy.py); the LM head runs outside them.
                first = {name: plan.dense_first_bucket for name in timed if is_dense(name)}
                choices, timings = autotune.choose(timed, plan.in_features, timer, dtype=plan.dtype,
                                                   first_bucket=first)
                load = autotune.other_load(before, autotune.cpu_snapshot())
                table.record(key, choices, timings, load)
                if load >= autotune.BUSY_LOAD:
                    logger.info("cpu kernel autotune %s: other processes kept %.0f%% of the CPUs busy while it was "
                                "measured; a quieter start measures it again", key, 100 * load)
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
            if is_lm_head(layer):
                logger.info("LM head %s", head_summary(layer, choices, copy_nbytes))
        _log(key, choices, table.entries[key].get("ms", {}), len(plans))
    if extra:
        logger.info("cpu kernel autotune: layers keeping two copies of their weight (one per kernel) add %s",
                    format_bytes(extra))


def is_lm_head(layer: nn.Module) -> bool:
    """Whether a linear layer is a model's LM head (its outputs are the logits)."""
    return getattr(layer, "prefix", "").rsplit(".", 1)[-1] == "lm_head"


def head_summary(layer: nn.Module, choices: list[str], copy_nbytes: int) -> str:
    """What the LM head keeps and runs per range of rows, for the start-up log: "49152x576 (gguf Q8_0): the
    quantized weight (dot4/avx512) for 1-32 rows; a dense f32 copy (dense-f32/blas) from 33 rows, the copies add
    108.0 MiB"."""
    ranges: list[tuple[str, int, int]] = []  # (kernel, first bucket, last bucket)
    for b, name in enumerate(choices):
        if ranges and ranges[-1][0] == name:
            ranges[-1] = (name, ranges[-1][1], b)
        else:
            ranges.append((name, b, b))
    buckets = autotune.bucket_ranges()
    parts = []
    for name, first, last in ranges:
        if first == 0 and last == len(choices) - 1:
            span = "at every batch size"
        elif last == len(choices) - 1:
            span = f"from {buckets[first][0]} rows"
        else:
            span = f"for {buckets[first][0]}-{buckets[last][1]} rows"
        what = (f"a dense {name[len(PREFIX):].split('/')[0]} copy ({name})" if is_dense(name)
                else f"the quantized weight ({name})")
        parts.append(f"{what} {span}")
    scheme = layer.quant_method.scheme(layer)
    size = f", the copies add {format_bytes(copy_nbytes)}" if copy_nbytes else ""
    return f"{layer.out_features}x{layer.in_features} ({scheme}): " + "; ".join(parts) + size


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
