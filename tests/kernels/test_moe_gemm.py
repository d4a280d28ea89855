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


@pytest.mark.parametrize("scoring,renormalize,top_k", [("softmax_topk", True, 2), ("softmax_topk", False, 4),
                                                       ("topk_softmax", False, 3), ("softmax_topk", True, 1)])
@pytest.mark.parametrize("tokens", [1, 37])
def test_moe_route_gather_and_combine_equal_the_torch_routing(kernels, scoring: str, renormalize: bool, top_k: int,
                                                               tokens: int) -> None:
    """moe_route = select_experts + group_by_expert (same rows in the same order, weights to float rounding);
    moe_gather_rows = index_select; moe_combine = the weighted index_add back per token."""
    from pagedllm.model_executor.layers.fused_moe import RoutingRule, select_experts
    from pagedllm.model_executor.layers.fused_moe.grouping import group_by_expert

    rule = RoutingRule(8, top_k, scoring, renormalize=renormalize)
    g = torch.Generator().manual_seed(tokens + top_k)
    logits, x = torch.randn(tokens, 8, generator=g), torch.randn(tokens, 24, generator=g)
    want = group_by_expert(*select_experts(logits, rule), rule.num_experts)
    rows = tokens * top_k
    token_of, weight = torch.empty(rows, dtype=torch.int64), torch.empty(rows, 1)
    ends = torch.empty(8, dtype=torch.int32)
    kernels.moe_route(logits, top_k, scoring == "topk_softmax", renormalize, token_of, weight, ends)
    assert torch.equal(ends, want.ends) and torch.equal(token_of, want.token_of)
    torch.testing.assert_close(weight, want.weight, atol=1e-6, rtol=1e-6)
    gathered = torch.empty(rows, 24)
    kernels.moe_gather_rows(x, token_of, gathered)
    assert torch.equal(gathered, x.index_select(0, token_of))
    y = torch.randn(rows, 24, generator=g)
    out = torch.full((tokens, 24), float("nan"))  # overwritten, not accumulated into
    kernels.moe_combine(y, token_of, weight, out)
    torch.testing.assert_close(out, torch.zeros(tokens, 24).index_add_(0, token_of, y * weight), atol=1e-6, rtol=1e-6)


def test_moe_route_checks_its_buffers(kernels) -> None:
    logits = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"token_of must be contiguous int64 \[T \* k\]"):
        kernels.moe_route(logits, 2, False, True, torch.empty(5, dtype=torch.int64), torch.empty(6, 1),
                          torch.empty(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="top_k must be between 1 and the number of experts"):
        kernels.moe_route(logits, 5, False, True, torch.empty(15, dtype=torch.int64), torch.empty(15, 1),
                          torch.empty(4, dtype=torch.int32))


def test_moe_combine_adds_the_gated_shared_expert(kernels) -> None:
    g = torch.Generator().manual_seed(7)
    token_of = torch.tensor([2, 0, 1, 2, 0, 1])
    weight, y = torch.rand(6, 1, generator=g), torch.randn(6, 40, generator=g)
    shared, gate = torch.randn(3, 40, generator=g), torch.randn(3, 1, generator=g)
    out = torch.empty(3, 40)
    kernels.moe_combine(y, token_of, weight, out, shared, gate)
    want = torch.zeros(3, 40).index_add_(0, token_of, y * weight) + torch.sigmoid(gate) * shared
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="shared and shared_gate come together"):
        kernels.moe_combine(y, token_of, weight, out, shared, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_heads_in_place_equals_rms_norm_of_each_head(kernels, dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k norms inside the fused qkv rows (strided), as the row kernel gives each head alone;
    the v columns are left as they are."""
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    wq, wk = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    want = qkv.clone()
    want[:, :heads * d] = kernels.rms_norm(qkv[:, :heads * d].reshape(-1, d), wq, 1e-6).view(5, -1)
    want[:, heads * d:(heads + kv_heads) * d] = kernels.rms_norm(
        qkv[:, heads * d:(heads + kv_heads) * d].reshape(-1, d), wk, 1e-6).view(5, -1)
    kernels.rms_norm_heads_(qkv, wq, 0, heads, 1e-6)
    kernels.rms_norm_heads_(qkv, wk, heads * d, kv_heads, 1e-6)
    assert torch.equal(qkv, want)
    with pytest.raises(RuntimeError, match="the heads run past x's columns"):
        kernels.rms_norm_heads_(qkv, wk, heads * d, 5, 1e-6)


def test_gather_and_combine_refuse_tokens_out_of_range(kernels) -> None:
    x = torch.randn(3, 8)
    rows = torch.empty(2, 8)
    with pytest.raises(RuntimeError, match="token_of"):
        kernels.moe_gather_rows(x, torch.tensor([0, 3]), rows)
    with pytest.raises(RuntimeError, match="token_of"):
        kernels.moe_combine(torch.randn(2, 8), torch.tensor([-1, 0]), torch.ones(2, 1), torch.empty(3, 8))


@pytest.mark.parametrize("counts", [[1, 0, 0, 2], [0, 3, 0, 0, 1], [20, 0, 9, 33]])
def test_moe_bf16_gemm_equals_each_expert_alone(kernels, counts: list[int]) -> None:
    """bf16 experts stacked as bf16_gemm's panels: each run of rows equals its expert's bf16_gemm bit for bit (the
    AVX-512 BF16 tiles where the CPU has them, and the portable loop)."""
    from pagedllm.model_executor.layers.quantization.float_weights import pack_bf16_weight

    torch.manual_seed(sum(counts))
    n, k = 40, 64
    w = torch.randn(len(counts), n, k).bfloat16()
    packed = torch.stack([pack_bf16_weight(w[e]) for e in range(len(counts))])
    x = torch.randn(sum(counts), k).bfloat16()
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    for generic in [True] + ([False] if kernels.bf16_gemm_supported() else []):
        got = kernels.moe_bf16_gemm(x, packed, ends, n, generic=generic)
        start = 0
        for e, rows in enumerate(counts):
            want = kernels.bf16_gemm(x[start:start + rows], packed[e], n, generic=generic)
            assert torch.equal(got[start:start + rows], want)
            start += rows
    with pytest.raises(RuntimeError, match="experts"):
        kernels.moe_bf16_gemm(x, packed, ends[:-1], n, generic=True)


def test_routing_kernels_take_bf16_rows(kernels) -> None:
    """A bf16 model's MoE layer routed in C++: bf16 router logits scored in float32 (the float32 logits' experts),
    bf16 rows gathered as they are, the weighted sums (and the gated shared expert) in float32 rounded once."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 8, generator=g).bfloat16()
    routed = [torch.empty(10, dtype=torch.int64), torch.empty(10, 1), torch.empty(8, dtype=torch.int32)]
    kernels.moe_route(logits, 2, False, True, *routed)
    want = [torch.empty(10, dtype=torch.int64), torch.empty(10, 1), torch.empty(8, dtype=torch.int32)]
    kernels.moe_route(logits.float(), 2, False, True, *want)
    assert all(torch.equal(a, b) for a, b in zip(routed, want, strict=True))
    token_of, weight, _ = routed
    x = torch.randn(5, 24, generator=g).bfloat16()
    rows = torch.empty(10, 24, dtype=torch.bfloat16)
    kernels.moe_gather_rows(x, token_of, rows)
    assert torch.equal(rows, x.index_select(0, token_of))
    y = torch.randn(10, 24, generator=g).bfloat16()
    shared, gate = torch.randn(5, 24, generator=g).bfloat16(), torch.randn(5, 1, generator=g).bfloat16()
    out = torch.empty(5, 24, dtype=torch.bfloat16)
    kernels.moe_combine(y, token_of, weight, out, shared, gate)
    exact = torch.zeros(5, 24).index_add_(0, token_of, y.float() * weight)
    exact += torch.sigmoid(gate.float()) * shared.float()
    torch.testing.assert_close(out.float(), exact.bfloat16().float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="type"):
        kernels.moe_combine(y, token_of, weight, torch.empty(5, 24))  # out of another type than y
