"""The C++ multi-LoRA kernel (``lora_sgmv_``) against the torch reference (``segments.add_lora_term``): rows 1 to
256, ranks 8 / 16 / 64, slots mixed with base-model rows, fused bands with adapters of smaller rank (each band
writing its shard's columns, a band with no module, a module over the whole fused layer), float32 and bf16 rows,
float32 and bf16 slot buffers; and a row's result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels

from helpers.lora_helpers import lora_reference as _reference
from helpers.lora_helpers import random_row_slots as _row_slots
from helpers.lora_helpers import random_slot_buffers as _slots


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    assert k is not None and hasattr(k, "lora_sgmv_"), "the C++ CPU kernels must build on the test machine"
    return k


@pytest.mark.parametrize("rows", [1, 17, 64, 256])
@pytest.mark.parametrize("max_rank", [8, 16, 64])
@pytest.mark.parametrize(("dtype", "slot_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)])
def test_kernel_equals_the_torch_reference(kernels, rows: int, max_rank: int, dtype: torch.dtype,
                                           slot_dtype: torch.dtype) -> None:
    k, n, bands, num_slots = 96, 200, 3, 5  # n: a tail past the kernel's 128-column chunks
    # full, smaller, a slot with nothing on this layer, rank 1 with no module on band 1, one module over all bands
    ranks = [max_rank, max_rank // 2, 0, 1, max_rank]
    a, b, slot_ranks, band_cols = _slots(num_slots, k, n, bands, max_rank, ranks, seed=rows + max_rank,
                                         missing=((3, 1),), whole=(4,))
    a, b = a.to(slot_dtype), b.to(slot_dtype)  # bf16 slots: the reference reads the same rounded values
    row_slots = _row_slots(rows, num_slots, seed=rows)
    if rows == 1:
        row_slots = [0]
    x = torch.randn(rows, k).to(dtype)
    y0 = torch.randn(rows, n).to(dtype)
    want = _reference(y0.clone(), x, a.float(), b.float(), row_slots)
    got = y0.clone()
    kernels.lora_sgmv_(got, x, a, b, slot_ranks, max_rank, torch.tensor(row_slots, dtype=torch.int32), band_cols)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # bf16 slots on a CPU with AVX-512 BF16 round h = x A to bf16 before B: an error relative to the term's size.
    term = (want.float() - y0.float()).abs().max().item()
    atol = tol if slot_dtype == torch.float32 else max(tol, 2.0 ** -8 * term)
    torch.testing.assert_close(got, want, rtol=tol, atol=atol)
    base = torch.tensor([s < 0 or ranks[s] == 0 for s in row_slots])
    assert torch.equal(got[base], y0[base])  # rows of the base model (or of a slot with rank 0) untouched
    if (~base).any():
        assert not torch.equal(got[~base], y0[~base])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_neighbours(kernels, dtype: torch.dtype) -> None:
    """Float32, and bf16 rows and slots (the vdpbf16ps tiles where the CPU has them); K odd: the last k unpaired."""
    a, b, ranks, cols = _slots(3, 63, 130, 2, 16, [16, 7, 16], seed=1)
    a, b = a.to(dtype), b.to(dtype)
    x = torch.randn(40, 63).to(dtype)
    row_slots = _row_slots(40, 3, seed=2)
    full = torch.zeros(40, 130, dtype=dtype)
    kernels.lora_sgmv_(full, x, a, b, ranks, 16, torch.tensor(row_slots, dtype=torch.int32), cols)
    for row in (0, 7, 39):
        alone = torch.zeros(1, 130, dtype=dtype)
        kernels.lora_sgmv_(alone, x[row:row + 1], a, b, ranks, 16,
                           torch.tensor(row_slots[row:row + 1], dtype=torch.int32), cols)
        assert torch.equal(alone[0], full[row])
    want = _reference(torch.zeros(40, 130), x.float(), a.float(), b.float(), row_slots)
    term = want.abs().max().item()
    torch.testing.assert_close(full.float(), want, rtol=2e-2, atol=2.0 ** -7 * term)


def test_strided_rows_and_bad_arguments(kernels) -> None:
    a, b, ranks, cols = _slots(2, 32, 48, 1, 8, [8, 8], seed=3)
    wide = torch.randn(5, 80)
    x = wide[:, :32]  # rows of x with a stride (a slice of a fused output)
    y_wide = torch.zeros(5, 100)
    y = y_wide[:, 10:58]
    row_slots = [1, -1, 0, 0, 1]
    kernels.lora_sgmv_(y, x, a, b, ranks, 8, torch.tensor(row_slots, dtype=torch.int32), cols)
    torch.testing.assert_close(y, _reference(torch.zeros(5, 48), x.contiguous(), a, b, row_slots))
    assert torch.equal(y_wide[:, :10], torch.zeros(5, 10))
    with pytest.raises(RuntimeError, match="names slot 2 of 2"):
        kernels.lora_sgmv_(torch.zeros(1, 48), x[:1], a, b, ranks, 8, torch.tensor([2], dtype=torch.int32), cols)
    with pytest.raises(RuntimeError, match="row_slots must be int32"):
        kernels.lora_sgmv_(torch.zeros(1, 48), x[:1], a, b, ranks, 8, torch.tensor([0]), cols)
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        kernels.lora_sgmv_(torch.zeros(1, 47), x[:1], a, b, ranks, 8, torch.tensor([0], dtype=torch.int32), cols)
    with pytest.raises(RuntimeError, match="band_cols must be int32"):
        kernels.lora_sgmv_(torch.zeros(1, 48), x[:1], a, b, ranks, 8, torch.tensor([0], dtype=torch.int32),
                           cols.long())
    with pytest.raises(RuntimeError, match="not a range of 0..48"):
        kernels.lora_sgmv_(torch.zeros(1, 48), x[:1], a, b, ranks, 8, torch.tensor([0], dtype=torch.int32),
                           torch.tensor([[[0, 49]], [[0, 48]]], dtype=torch.int32))
