"""Micro-benchmark: our quantized matmul kernels vs fp32 packed panels and torch's weight-only int8/int4 ops,
on the default model's layer shapes, per ISA.

    PYTHONPATH=. python benchmarks/quant_matmul.py --rows 1 4 16 --repeat 200

Prints milliseconds per call (median of --repeat). Run on a quiet machine: numbers under contention mean
nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.kernels.cpu import ISA_CODES, load_cpu_kernels
from pagedllm.model_executor.layers.quantization.qpanels import QPanels, quantize_f8, quantize_q4, quantize_q8
from pagedllm.model_executor.layers.quantization.unquantized import pack_weight

SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}


def _time(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_shape(kernels: Any, n: int, k: int, m: int, isas: list[str], repeat: int) -> dict[str, float]:
    """Milliseconds per call of every variant on one [m, k] x [n, k]^T problem."""
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k)
    packed = pack_weight(w)
    q8, s8 = quantize_q8(w, k)
    per_channel = QPanels.pack_q8(q8, s8)
    q8_g32 = QPanels.pack_q8(*quantize_q8(w, 32))
    q4_g32 = QPanels.pack_q4(*quantize_q4(w, 32))
    f8_ch = QPanels.pack_f8(*quantize_f8(w, k))
    int4_torch = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    scales_zeros = torch.ones(k // 32, n, 2, dtype=torch.bfloat16)
    xb = x.bfloat16()
    row = {"fp32 panels": _time(lambda: kernels.packed_gemm(x, packed, n), repeat),
           "torch int8pack": _time(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8[:, 0]), repeat),
           "torch int4pack(bf16)": _time(lambda: torch._weight_int4pack_mm_for_cpu(xb, int4_torch, 32, scales_zeros),
                                         repeat)}
    for isa in isas:
        code = ISA_CODES[isa]
        row[f"int8/ch {isa}"] = _time(lambda: per_channel.matmul(x, isa=code), repeat)  # noqa: B023
        row[f"q8 g32 {isa}"] = _time(lambda: q8_g32.matmul(x, isa=code), repeat)  # noqa: B023
        row[f"q4 g32 {isa}"] = _time(lambda: q4_g32.matmul(x, isa=code), repeat)  # noqa: B023
        row[f"fp8/ch {isa}"] = _time(lambda: f8_ch.matmul(x, isa=code), repeat)  # noqa: B023
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build"
    isas = [n for n, c in ISA_CODES.items() if c in set(kernels.supported_isas()) and n not in ("generic", "auto")]
    print(f"threads {torch.get_num_threads()}, ISAs {isas}; ms per call (median)")
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for m in args.rows:
            row = bench_shape(kernels, n, k, m, isas, args.repeat)
            print(f"{shape:>20} M={m:<4} " + "  ".join(f"{name} {ms:.3f}" for name, ms in row.items()), flush=True)


if __name__ == "__main__":
    main()
