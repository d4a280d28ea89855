"""Triton's MoE kernels (the CUDA path, ``kernels/triton_moe.py``) through the interpreter on the CPU: the tile map
covers each expert's rows once, the grouped matmul equals the per-expert loop for float and quantized weights (with
the gather, biases, experts without rows), the combine equals the weighted sum per token and leaves other ranks'
rows out; the ``FusedMoE`` layer and whole MoE models on that path equal the reference and transformers. On a GPU
machine run with PAGEDLLM_TEST_DEVICE=cuda TRITON_INTERPRET=0."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.kernels import triton_ops  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_ops.triton_available(), reason="triton is a test dependency")

from pagedllm.kernels.triton_moe import StackedRows, expert_tiles, moe_combine, moe_grouped_matmul  # noqa: E402
from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule  # noqa: E402
from pagedllm.model_executor.layers.fused_moe.grouping import group_by_expert  # noqa: E402
from pagedllm.model_executor.layers.fused_moe.reference import reference_moe  # noqa: E402
from pagedllm.model_executor.layers.quantization.qpanels import quantize_f8, quantize_q4, quantize_q8  # noqa: E402
from pagedllm.model_executor.layers.quantization.qrows import QRows  # noqa: E402
from pagedllm.platforms import platform_of  # noqa: E402


def _ends(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)


@pytest.mark.parametrize("counts", [[3, 0, 17, 1, 0, 32], [0, 0, 5], [1], [16, 16], [0, 40, 0, 0]])
@pytest.mark.parametrize("block_m", [16, 64])
def test_tiles_cover_each_experts_rows_once(counts: list[int], block_m: int) -> None:
    tiles = expert_tiles(_ends(counts), sum(counts), block_m)
    assert tiles.num_tiles == -(-sum(counts) // block_m) + len(counts)  # fixed by (R, E): a graph can record it
    covered = []
    for e, s, t in zip(tiles.expert.tolist(), tiles.start.tolist(), tiles.end.tolist(), strict=True):
        if e < 0:
            continue
        first = sum(counts[:e])
        assert first <= s < t == first + counts[e] and s - first < counts[e]
        covered += [(e, r) for r in range(s, min(s + block_m, t))]
    want = [(e, sum(counts[:e]) + i) for e, c in enumerate(counts) for i in range(c)]
    assert covered == want


def _loop(a: torch.Tensor, weights: torch.Tensor, counts: list[int], bias: torch.Tensor | None) -> torch.Tensor:
    """Sorted rows [R, K] through the per-expert float weights [E, N, K] one expert at a time, float32."""
    out, start = [], 0
    for e, c in enumerate(counts):
        y = a[start:start + c].float() @ weights[e].float().T
        out.append(y + bias[e].float() if bias is not None else y)
        start += c
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_matmul_equals_the_per_expert_loop(dtype: torch.dtype, gather: bool, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(3)
    counts, n, k = [3, 0, 21, 1, 0, 5], 40, 48  # N, K not multiples of the tiles; experts 1 and 4 have no rows
    weights = (torch.randn(len(counts), n, k, generator=g) * 0.1).to(dtype)
    bias = (torch.randn(len(counts), n, generator=g) * 0.1).to(dtype) if with_bias else None
    x = torch.randn(9, k, generator=g).to(dtype)
    token_of = torch.randint(0, 9, (sum(counts),), generator=g)
    rows = x[token_of]
    ends = _ends(counts)
    for block_m in (16, 64):
        tiles = expert_tiles(ends, sum(counts), block_m)
        got = moe_grouped_matmul(*((x.to(DEVICE),) if gather else (rows.to(DEVICE),)), weights.to(DEVICE), tiles,
                                 sum(counts), token_of=token_of.to(DEVICE) if gather else None,
                                 bias=bias.to(DEVICE) if bias is not None else None)
        assert got.dtype == dtype and got.shape == (sum(counts), n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu().float(), _loop(rows, weights, counts, bias), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["q8", "q4", "f8"])
@pytest.mark.parametrize("group", [16, 64])
def test_quantized_rows_equal_their_dequantized_weights(kind: str, group: int) -> None:
    g = torch.Generator().manual_seed(4)
    counts, n, k = [2, 0, 19, 4], 36, 64
    quantize = {"q8": (quantize_q8, QRows.pack_q8), "q4": (quantize_q4, QRows.pack_q4),
                "f8": (quantize_f8, QRows.pack_f8)}
    packs = [quantize[kind][1](*quantize[kind][0](torch.randn(n, k, generator=g) * 0.1, group)) for _ in counts]
    stacked = StackedRows(torch.stack([p.qweight for p in packs]).to(DEVICE),
                          torch.stack([p.scales for p in packs]).to(DEVICE),
                          torch.stack([p.mins for p in packs]).to(DEVICE) if packs[0].mins is not None else None,
                          packs[0].kind, group, n, k)
    rows = torch.randn(sum(counts), k, generator=g)
    tiles = expert_tiles(_ends(counts), sum(counts), 16)
    got = moe_grouped_matmul(rows.to(DEVICE), stacked, tiles, sum(counts))
    want = _loop(rows, torch.stack([p.dequantize() for p in packs]), counts, None)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_combine_sums_each_tokens_slots_and_leaves_other_ranks_rows_out() -> None:
    g = torch.Generator().manual_seed(5)
    tokens, top_k, h, num_experts = 6, 3, 40, 5
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    groups = group_by_expert(weights, ids, num_experts)
    y = torch.randn(groups.num_rows, h, generator=g)
    want = torch.zeros(tokens, h).index_add_(0, groups.token_of, y * groups.weight)
    got = moe_combine(y.to(DEVICE), groups.slot_rows().to(DEVICE), groups.weight.to(DEVICE), tokens, top_k,
                      torch.float32)
    torch.testing.assert_close(got.cpu(), want)
    # Expert parallelism: this rank holds experts [0, 2); rows of the others are past its rows and add nothing.
    local = group_by_expert(weights, ids, num_experts).first_experts(2)
    y_local = y[:local.num_rows]
    want_local = torch.zeros(tokens, h).index_add_(0, local.token_of, y_local * local.weight)
    got_local = moe_combine(y_local.to(DEVICE), local.slot_rows().to(DEVICE), local.weight.to(DEVICE), tokens,
                            top_k, torch.float32)
    torch.testing.assert_close(got_local.cpu(), want_local)


@pytest.fixture
def triton_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The platform of CPU tensors packs quantized weights by rows, as CUDA does: layers take the Triton forms,
    which the interpreter runs."""
    if DEVICE == "cpu":
        monkeypatch.setattr(type(platform_of(torch.empty(0))), "packs_quantized_by_rows", True)


def _moe_layer(rule: RoutingRule, hidden: int, inter: int, dtype: torch.dtype, bias: bool = False,
               quant_config=None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rule.num_experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(rule.num_experts, hidden, inter, generator=g) * 0.1
    biases = (torch.randn(rule.num_experts, 2 * inter, generator=g) * 0.1,
              torch.randn(rule.num_experts, hidden, generator=g) * 0.1) if bias else (None, None)
    layer = FusedMoE(rule, hidden, inter, dtype=dtype, quant_config=quant_config, bias=bias, prefix="mlp.experts")
    layer = layer.to(DEVICE)
    layer.gate_up_proj.weight_loader(layer.gate_up_proj, gate_up.to(dtype), None)
    layer.down_proj.weight_loader(layer.down_proj, down.to(dtype), None)
    if bias:
        layer.gate_up_proj_bias.weight_loader(layer.gate_up_proj_bias, biases[0].to(dtype))
        layer.down_proj_bias.weight_loader(layer.down_proj_bias, biases[1].to(dtype))
    layer.process_weights_after_loading()
    return layer, gate_up.to(dtype), down.to(dtype), biases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_moe_layer_on_the_triton_path_equals_the_reference(triton_experts, dtype: torch.dtype,
                                                                 bias: bool) -> None:
    rule = RoutingRule(8, 2, "softmax_topk", renormalize=True)
    layer, gate_up, down, biases = _moe_layer(rule, 32, 48, dtype, bias=bias)
    assert layer.describe() == f"{str(dtype).removeprefix('torch.')} grouped (triton)"
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 5, 37):  # a decode token, a small batch, a prefill of several tiles per expert
        x = torch.randn(tokens, 32, generator=g).to(dtype)
        logits = torch.randn(tokens, 8, generator=g)
        got = layer(x.to(DEVICE), logits.to(DEVICE))
        assert got.dtype == dtype
        want = reference_moe(x, logits, gate_up, down, rule, biases[0], biases[1])
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol)


def test_int8_experts_run_stacked_rows(triton_experts) -> None:
    from pagedllm.model_executor.layers.quantization import get_quantization_config

    rule = RoutingRule(6, 3, "topk_softmax")
    layer, gate_up, down, _ = _moe_layer(rule, 32, 64, torch.float32, quant_config=get_quantization_config("int8"))
    assert layer.describe() == "int8 per-channel stacked rows (triton)"
    assert layer.gate_up_proj.numel() == 0 and layer._quantized is None  # one copy of the experts: the rows
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(9, 32, generator=g), torch.randn(9, 6, generator=g)
    got = layer(x.to(DEVICE), logits.to(DEVICE)).cpu()
    want = reference_moe(x, logits, gate_up, down, rule)
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # int8 per-channel: close, not equal
    deq = reference_moe(x, logits, torch.stack([layer._rows[0].qweight[e].float() * layer._rows[0].scales[e]
                                                for e in range(6)]),
                        torch.stack([layer._rows[1].qweight[e].float() * layer._rows[1].scales[e] for e in range(6)]),
                        rule)
    torch.testing.assert_close(got, deq, rtol=1e-5, atol=1e-5)  # exactly the stacked weights' arithmetic


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen2moe-e8-top4-shared", "gpt_oss"])
def test_moe_models_on_the_triton_path_equal_transformers(triton_experts, tmp_path, variant: str) -> None:
    """Whole tiny models whose experts run the Triton kernels (float32, through the interpreter): greedy tokens of a
    batch equal transformers' ``generate`` per prompt."""
    from pagedllm import LLM, SamplingParams

    from helpers.moe_configs import save_tiny_gpt_oss, save_tiny_moe

    path, hf = save_tiny_gpt_oss(tmp_path / "m") if variant == "gpt_oss" else save_tiny_moe(variant, tmp_path / "m")
    prompts = [[1, *range(10, 30)], [1, 7, 99, 3, 42, 8]]
    llm = LLM(path, dtype="float32", kv_cache_dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
              enforce_eager=True)
    layers = [m for m in llm.engine.core.worker.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.describe() == "float32 grouped (triton)" for m in layers)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()
