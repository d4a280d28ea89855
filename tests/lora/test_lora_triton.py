"""The Triton multi-LoRA kernel (CUDA path) against the torch reference, through Triton's interpreter on the CPU;
on a GPU machine run with PAGEDLLM_TEST_DEVICE=cuda TRITON_INTERPRET=0."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.kernels import triton_ops  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_ops.triton_available(), reason="triton is a test dependency")

from helpers.lora_helpers import lora_reference as _reference  # noqa: E402
from helpers.lora_helpers import random_row_slots as _row_slots  # noqa: E402
from helpers.lora_helpers import random_slot_buffers as _slots  # noqa: E402


@pytest.mark.parametrize("rows", [1, 17, 64])
@pytest.mark.parametrize("max_rank", [8, 16, 24])  # 24: a rank that is not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_the_torch_reference(rows: int, max_rank: int, dtype: torch.dtype) -> None:
    from pagedllm.kernels.triton_lora import lora_sgmv_

    k, n, bands, num_slots = 96, 200, 2, 3
    ranks = [max_rank, max_rank // 2, 0]
    a, b, slot_ranks = _slots(num_slots, k, n, bands, max_rank, ranks, seed=rows + max_rank)
    a, b = a.to(dtype), b.to(dtype)  # bf16 rows beside bf16 slot buffers, as a bf16 model keeps them
    row_slots = [0] if rows == 1 else _row_slots(rows, num_slots, seed=rows)
    x = torch.randn(rows, k).to(dtype)
    y0 = torch.randn(rows, n).to(dtype)
    want = _reference(y0.clone(), x, a.float(), b.float(), row_slots)
    got = y0.to(DEVICE, copy=True)
    lora_sgmv_(got, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), slot_ranks.to(DEVICE), max_rank,
               torch.tensor(row_slots, dtype=torch.int32, device=DEVICE))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    base = torch.tensor([s < 0 or ranks[s] == 0 for s in row_slots])
    assert torch.equal(got.cpu()[base], y0[base])
