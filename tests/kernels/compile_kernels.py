"""Compile every Triton kernel the engine launches on CUDA for Hopper (sm_90: H100 / H200) and Ampere (sm_80:
A100), without a GPU.

The interpreter tests check what the kernels compute, but the interpreter never lowers a kernel: a dot shape,
a dtype or a layout that the real compiler rejects, or a tile that spills registers, would first show on a
GPU. Here the engine's own launch functions run on CPU tensors while each kernel is swapped for a recorder,
so every recorded launch carries exactly the constexprs and argument types the engine passes on a GPU of that
architecture (``PAGEDLLM_TRITON_ARCH``, read by ``triton_ops.target_arch``). Each is compiled to a cubin
(Triton's compiler and the ptxas it bundles) and the cubin's registers, stack and spills are read with the
bundled ``cuobjdump``.

Shapes: SmolLM2-135M (the default model: 9 heads over 3 KV heads of 64, hidden 576, MLP 1536), Gemma 3 270M
(heads of 256, sliding window 512), a Llama-3-8B-sized layer (32 heads over 8 of 128, MLP 14336), and a
Qwen3-30B-A3B-sized MoE layer (128 experts of 768, top-8, hidden 2048) at decode and prefill.

    python tests/kernels/compile_kernels.py --arch 90        # a table (default: --arch 90,80)
    python tests/kernels/compile_kernels.py --output-json F  # the rows as JSON (read by its test)

Run it without TRITON_INTERPRET (it removes it): triton picks the interpreter when kernels are defined.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from pagedllm.attention.backends import triton_paged  # noqa: E402
from pagedllm.attention.metadata import build_attention_metadata  # noqa: E402
from pagedllm.kernels import triton_moe, triton_ops  # noqa: E402
from pagedllm.kernels import triton_quant_matmul as tqm  # noqa: E402
from pagedllm.model_executor.layers.quantization.qpanels import quantize_f8, quantize_q4, quantize_q8  # noqa: E402
from pagedllm.model_executor.layers.quantization.qrows import QRows  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_Q", "BLOCK", "BLOCK_H", "DOT_BF16", "DOT_FP32", "DOT_HALF",
             "WINDOW", "KIND", "GATHER", "NUM_SPLITS", "SPLIT_K")


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, kernel: JITFunction, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple):
        if not all(int(g) > 0 for g in grid):
            raise ValueError(f"empty grid {grid}")
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


def record(run: Callable[[], None]) -> list[Launch]:
    """The launches ``run`` makes through the engine's launch functions."""
    launches: list[Launch] = []
    swapped = [(triton_paged, "_paged_attention_kernel"), (triton_paged, "_combine_splits_kernel"),
               (triton_ops, "_rms_norm_kernel"),
               (triton_ops, "_silu_and_mul_kernel"), (triton_ops, "_rotary_kernel"), (tqm, "_wo_matmul_kernel"),
               (tqm, "_sum_splits_kernel"), (triton_moe, "_moe_gemm_kernel"), (triton_moe, "_moe_combine_kernel")]
    originals = [getattr(module, name) for module, name in swapped]
    for (module, name), kernel in zip(swapped, originals):
        setattr(module, name, Recorder(kernel, launches))
    try:
        run()
    finally:
        for (module, name), kernel in zip(swapped, originals):
            setattr(module, name, kernel)
    return launches


def compile_for(launch: Launch, target: GPUTarget) -> Any:
    """The launch's kernel compiled to a cubin for ``target``."""
    fn = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def resource_usage(compiled: Any, folder: Path) -> dict[str, int]:
    """REG / STACK / LOCAL of the cubin's kernel, as cuobjdump reports them."""
    path = folder / f"{compiled.metadata.name}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                          check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", line)}


# ---- the launches: each case runs the engine's launch functions as a step of that model would ----------------
ATTENTION = {"smollm2": (9, 3, 64, 0), "gemma3": (4, 1, 256, 512), "llama8b": (32, 8, 128, 0)}  # H, Hkv, D, window
ELEMENTWISE = {"smollm2": (576, 1536), "gemma3": (640, 2048), "llama8b": (4096, 14336)}  # hidden, MLP
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTIZE = {"q8": (quantize_q8, QRows.pack_q8), "q4": (quantize_q4, QRows.pack_q4), "f8": (quantize_f8, QRows.pack_f8)}


def attention_step(dtype: torch.dtype, model: str, query_lens: list[int], num_splits: int | None = None) -> None:
    """One step of paged attention: decodes first, then prompts or chunks (block size 16); ``num_splits``:
    a decode-only step split over the context (flash-decoding) and combined."""
    heads, kv_heads, head_dim, window = ATTENTION[model]
    block_size = 16
    seq_lens = [q + 20 for q in query_lens]
    tables = [[1 + i * 16 + b for b in range(-(-s // block_size))] for i, s in enumerate(seq_lens)]
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    t = sum(query_lens)
    cache = torch.zeros(2, 16 * len(query_lens) + 1, block_size, kv_heads, head_dim, dtype=dtype)
    kv = torch.zeros(t, kv_heads, head_dim, dtype=dtype)
    triton_paged.triton_paged_attention(torch.zeros(t, heads, head_dim, dtype=dtype), kv, kv, cache, meta,
                                        head_dim ** -0.5, sliding_window=window, num_splits=num_splits)


def elementwise_ops(dtype: torch.dtype, model: str) -> None:
    """A decoder layer's RMSNorms (with and without the residual), SiLU-and-mul, rotary, and rotary fused with
    the KV-cache write."""
    hidden, inter = ELEMENTWISE[model]
    heads, kv_heads, head_dim, _ = ATTENTION[model]
    x = torch.zeros(8, hidden, dtype=dtype)
    weight = torch.ones(hidden, dtype=dtype)
    triton_ops.rms_norm_(x, x.clone(), weight, 1e-6)
    triton_ops.rms_norm_(x, None, weight, 1e-6)
    triton_ops.silu_and_mul(torch.zeros(8, 2 * inter, dtype=dtype))
    qkv = torch.zeros(8, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    table = torch.zeros(64, head_dim)
    triton_ops.rotary_(qkv, torch.arange(8), table, heads + kv_heads, head_dim)
    cache = torch.zeros(2, 4, 16, kv_heads, head_dim, dtype=dtype)
    triton_ops.rotary_and_write_kv_(qkv, torch.arange(8), table, heads, kv_heads, head_dim, cache, torch.arange(8))


def quantized_matmul(dtype: torch.dtype, kind: str, group: int, m: int) -> None:
    """The call QRows.matmul makes on a CUDA tensor: [m, 768] @ a quantized [96, 768]^T (+ bias)."""
    quantize, pack = QUANTIZE[kind]
    rows = pack(*quantize(torch.randn(96, 768), group))
    tqm.weight_only_matmul(torch.zeros(m, 768, dtype=dtype), rows.qweight, rows.scales, rows.mins, rows.group,
                           rows.out_features, rows.kind, torch.zeros(96, dtype=dtype))


MOE = (128, 8, 2048, 768)  # experts, top-k, hidden, intermediate (Qwen3-30B-A3B)


def moe_layer(dtype: torch.dtype, kind: str | None, tokens: int) -> None:
    """The launches of ``FusedMoE._experts_triton`` for ``tokens`` tokens: both projections (the first gathering x)
    with float or quantized (group 128) experts, then the combine."""
    experts, top_k, hidden, inter = MOE
    ids = torch.arange(tokens * top_k).remainder(experts).reshape(tokens, top_k)
    from pagedllm.model_executor.layers.fused_moe.grouping import group_by_expert

    groups = group_by_expert(torch.full((tokens, top_k), 1.0 / top_k), ids, experts)
    tiles = triton_moe.expert_tiles(groups.ends, groups.num_rows, triton_moe.block_m_for(groups.num_rows, experts))

    def weight(n: int, k: int) -> torch.Tensor | triton_moe.StackedRows:
        if kind is None:  # one expert's zeros seen E times (128 real experts would take gigabytes here)
            return torch.zeros(1, n, k, dtype=dtype).expand(experts, n, k)
        quantize, pack = QUANTIZE[kind]
        one = pack(*quantize(torch.randn(n, k), 128))
        return triton_moe.StackedRows(one.qweight.expand(experts, *one.qweight.shape), one.scales.expand(
            experts, *one.scales.shape), None if one.mins is None else one.mins.expand(experts, *one.mins.shape),
            one.kind, one.group, n, k)

    x = torch.zeros(tokens, hidden, dtype=dtype)
    gate_up = triton_moe.moe_grouped_matmul(x, weight(2 * inter, hidden), tiles, groups.num_rows,
                                            token_of=groups.token_of)
    y = triton_moe.moe_grouped_matmul(gate_up[:, :inter], weight(hidden, inter), tiles, groups.num_rows)
    triton_moe.moe_combine(y, groups.slot_rows(), groups.weight, tokens, top_k, dtype)


def cases() -> list[tuple[str, Callable[[], None]]]:
    out: list[tuple[str, Callable[[], None]]] = []
    for dname, dtype in DTYPES.items():
        for model in ATTENTION:
            out.append((f"attention {model} decode {dname}", lambda d=dtype, m=model: attention_step(d, m, [1, 1, 1])))
            out.append((f"attention {model} decode-split {dname}",
                        lambda d=dtype, m=model: attention_step(d, m, [1], num_splits=16)))
            out.append((f"attention {model} mixed {dname}",
                        lambda d=dtype, m=model: attention_step(d, m, [1, 1, 37, 100])))
            out.append((f"elementwise {model} {dname}", lambda d=dtype, m=model: elementwise_ops(d, m)))
        for kind in QUANTIZE:
            for group in (32, 128, 768):
                for m in (1, 20, 100):
                    out.append((f"quant {kind} g{group} m{m} {dname}",
                                lambda d=dtype, k=kind, g=group, mm=m: quantized_matmul(d, k, g, mm)))
        for kind in (None, *QUANTIZE):
            for tokens in (1, 64):
                out.append((f"moe {kind or 'float'} t{tokens} {dname}",
                            lambda d=dtype, k=kind, t=tokens: moe_layer(d, k, t)))
    return out


def report(arch: int) -> list[dict[str, Any]]:
    """One row per recorded launch for ``arch`` (90: sm_90): the case, the kernel, its tile constexprs,
    resources, tensor-core use."""
    os.environ["PAGEDLLM_TRITON_ARCH"] = str(arch)  # the launch functions tune for it
    target = GPUTarget("cuda", arch, 32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case, run in cases():
            for launch in record(run):
                row: dict[str, Any] = {"arch": arch, "case": case, "kernel": launch.kernel.fn.__name__,
                                       **{k: v for k, v in launch.kwargs.items() if k in TILE_KEYS}}
                try:
                    compiled = compile_for(launch, target)
                except Exception as exc:  # reported per launch: one bad kernel must not hide the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                else:
                    row.update(resource_usage(compiled, Path(tmp)), mma="mma" in compiled.asm["ptx"])
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90,80", help="comma-separated compute capabilities (default 90,80)")
    parser.add_argument("--output-json", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    rows = [row for arch in args.arch.split(",") for row in report(int(arch))]
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))
    for row in rows:
        tiles = " ".join(f"{k}={row[k]}" for k in TILE_KEYS if k in row)
        usage = row.get("error") or f"REG {row['REG']:3d} STACK {row['STACK']:3d} LOCAL {row['LOCAL']} mma {row['mma']}"
        print(f"sm_{row['arch']} {row['case']:32s} {row['kernel']:24s} {usage}  {tiles}")
    failed = sum(1 for row in rows if "error" in row)
    print(f"{len(rows)} launches compiled for sm_{args.arch.replace(',', ', sm_')}, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
