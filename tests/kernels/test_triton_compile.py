"""Every Triton kernel launch the engine makes on CUDA compiles for Hopper (sm_90: H100 / H200) and Ampere (sm_80:
A100), without a GPU.

``tests/kernels/compile_kernels.py`` records the launches through the engine's own launch functions and compiles
each one with Triton's compiler and bundled ptxas (see its docstring); it runs in a subprocess because triton
picks the interpreter, which the other Triton tests use, when kernels are defined.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# Compiles every launch for two GPU architectures: minutes. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sm90") / "launches.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_kernels.py")), "--output-json",
                           str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_launch_compiles(launches: list[dict]) -> None:
    failed = [(row["case"], row["kernel"], row["error"]) for row in launches if "error" in row]
    assert not failed, failed
    kernels = {row["kernel"] for row in launches}
    assert kernels == {"_paged_attention_kernel", "_combine_splits_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel",
                       "_rotary_kernel", "_wo_matmul_kernel", "_sum_splits_kernel", "_moe_gemm_kernel",
                       "_moe_combine_kernel"}
    assert any(row.get("SPLIT_K", 1) > 1 for row in launches)  # decode-sized quantized products split K
    assert {row["arch"] for row in launches} == {90, 80} and len(launches) >= 200


def test_no_launch_spills_registers(launches: list[dict]) -> None:
    """A kernel out of registers spills to local memory through its stack and runs several times slower. ptxas
    (run with Triton's --regAllocOptLevel=2) parks 8 bytes of a few split-K tiles on the stack at 80 registers,
    far from the limit: a few bytes away from the limit pass, a bigger frame or one at the limit does not."""
    spills = [(row["arch"], row["case"], row["kernel"], row["REG"], row["STACK"]) for row in launches
              if row["LOCAL"] or row["STACK"] > 16 or (row["STACK"] and row["REG"] >= 250)]
    assert not spills, spills


def test_half_precision_dots_use_tensor_cores_and_float32_stays_exact(launches: list[dict]) -> None:
    """bf16 / fp16 attention and quantized matmuls compile to mma instructions; float32 dots stay at full
    precision (no tf32), so a float32 engine computes attention like the float32 reference."""
    for row in launches:
        if row["kernel"] not in ("_paged_attention_kernel", "_wo_matmul_kernel", "_moe_gemm_kernel"):
            continue
        half = not row["case"].endswith("fp32")
        assert row["mma"] == half, row
        assert row.get("DOT_FP32", not half) == (not half) and row.get("DOT_BF16", half) == half, row
        assert row.get("DOT_HALF", half) == half, row


def test_tiles_follow_the_step(launches: list[dict]) -> None:
    """Decode-only steps use 16-row attention tiles; mixed steps on tensor cores bigger ones (fewer K/V
    re-reads)."""
    attention = [row for row in launches if row["kernel"] == "_paged_attention_kernel"]
    assert {row["BLOCK_M"] for row in attention if " decode" in row["case"]} == {16}
    assert all(row["BLOCK_M"] >= 32 for row in attention if " mixed " in row["case"] and not row["DOT_FP32"])
