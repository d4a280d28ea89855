"""The MoE experts kernel (``moe_packed_gemm``) against a per-expert ``F.linear``: row and column tails, experts
with no rows, one decode row, many rows over several row blocks, ``out=``, and argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model_executor.layers.quantization.float_weights import pack_weight


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    assert k is not None, "the C++ CPU kernels must build on the test machine"
    return k


def _experts(num_experts: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    w = torch.randn(num_experts, n, k)
    return w, torch.stack([pack_weight(w[e]) for e in range(num_experts)])


def _reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(F.linear(x[start:start + c], w[e]))
        start += c
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[1, 0, 0, 0], [0, 0, 1, 0, 1, 0, 0, 1], [3, 0, 7, 13, 0, 2], [301, 0, 40]])
@pytest.mark.parametrize("n,k", [(96, 64), (33, 40), (1536, 17), (48, 1536)])
def test_moe_packed_gemm_matches_each_expert(kernels, counts: list[int], n: int, k: int) -> None:
    w, packed = _experts(len(counts), n, k, seed=sum(counts) + n)
    x = torch.randn(sum(counts), k)
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    torch.testing.assert_close(kernels.moe_packed_gemm(x, packed, ends, n), _reference(x, w, counts),
                               atol=2e-4, rtol=1e-4)


def test_moe_packed_gemm_reads_only_experts_with_rows(kernels) -> None:
    w, packed = _experts(4, 32, 16, seed=0)
    packed[1].fill_(float("nan"))
    packed[3].fill_(float("nan"))
    x = torch.randn(3, 16)
    ends = torch.tensor([1, 1, 3, 3], dtype=torch.int32)
    got = kernels.moe_packed_gemm(x, packed, ends, 32)
    torch.testing.assert_close(got, _reference(x, w, [1, 0, 2, 0]), atol=1e-4, rtol=1e-4)


def test_moe_packed_gemm_writes_into_out_and_checks_arguments(kernels) -> None:
    w, packed = _experts(2, 20, 8, seed=1)
    x = torch.randn(5, 8)
    ends = torch.tensor([2, 5], dtype=torch.int32)
    buffer = torch.full((5, 30), 7.0)
    got = kernels.moe_packed_gemm(x, packed, ends, 20, buffer[:, :20])
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:, :20], _reference(x, w, [2, 3]), atol=1e-4, rtol=1e-4)
    assert bool((buffer[:, 20:] == 7.0).all())
    with pytest.raises(RuntimeError, match="must equal the rows of x"):
        kernels.moe_packed_gemm(x, packed, torch.tensor([2, 4], dtype=torch.int32), 20)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        kernels.moe_packed_gemm(x, packed, torch.tensor([6, 5], dtype=torch.int32), 20)
    with pytest.raises(RuntimeError, match="ends has 3 experts"):
        kernels.moe_packed_gemm(x, packed, torch.tensor([1, 2, 5], dtype=torch.int32), 20)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.moe_packed_gemm(torch.randn(5, 9), packed, ends, 20)
