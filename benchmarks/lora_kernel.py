"""The multi-LoRA term alone: ``lora_sgmv_`` on SmolLM2-135M's four adapted projections (q/k/v, o, gate/up, down)
x 30 layers, 8 slots of rank 16, rows spread round-robin over the slots, bf16 rows and slots (a bf16 model's);
milliseconds per step at each row count, as JSON.

    python benchmarks/lora_kernel.py                     # this checkout's kernels
    PYTHONPATH=/path/to/other/checkout python benchmarks/lora_kernel.py   # another's (its own build folder)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {"qkv_proj": (576, 3, 960), "o_proj": (576, 1, 576), "gate_up_proj": (576, 2, 3072),
          "down_proj": (1536, 1, 576)}  # (in, bands, out)
LAYERS, SLOTS, RANK = 30, 8, 16


def shard_columns(n: int, bands: int) -> list[tuple[int, int]]:
    """The output columns of each shard of a fused layer: q / k / v (9 and 3 heads of 64) or gate / up."""
    if bands == 3:
        return [(0, 576), (576, 768), (768, 960)]
    return [(n * band // bands, n * (band + 1) // bands) for band in range(bands)]


def step_ms(kernels, rows: int, dtype: torch.dtype) -> float:
    torch.manual_seed(0)
    total = 0.0
    for k, bands, n in SHAPES.values():
        r = bands * RANK
        a, b = (torch.randn(SLOTS, k, r) * 0.05).to(dtype), torch.zeros(SLOTS, r, n, dtype=dtype)
        cols = torch.zeros(SLOTS, bands, 2, dtype=torch.int32)
        for band, (lo, hi) in enumerate(shard_columns(n, bands)):  # each shard's B writes its own columns
            b[:, band * RANK:(band + 1) * RANK, lo:hi] = (torch.randn(SLOTS, RANK, hi - lo) * 0.05).to(dtype)
            cols[:, band] = torch.tensor([lo, hi], dtype=torch.int32)
        x, y = torch.randn(rows, k).to(dtype), torch.zeros(rows, n, dtype=dtype)
        ranks = torch.full((SLOTS,), RANK, dtype=torch.int32)
        row_slots = (torch.arange(rows) % SLOTS).to(torch.int32)
        for _ in range(5):
            kernels.lora_sgmv_(y, x, a, b, ranks, RANK, row_slots, cols)
        reps = max(5, 2000 // rows)
        start = time.perf_counter()
        for _ in range(reps):
            kernels.lora_sgmv_(y, x, a, b, ranks, RANK, row_slots, cols)
        total += (time.perf_counter() - start) / reps
    return 1000 * total * LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,200,2048", help="row counts, comma-separated")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    from pagedllm.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    result = {"dtype": args.dtype, "slots": SLOTS, "rank": RANK, "layers": LAYERS,
              "ms_per_step": {rows: round(step_ms(kernels, int(rows), dtype), 3) for rows in args.rows.split(",")}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
