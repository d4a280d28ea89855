"""Tensor and expert parallelism of MoE models through the mp executor. TP: each rank holds a slice of every
expert's intermediate dimension (and of the shared expert's), and DeepSeek's latent attention splits by heads; EP
(``--enable-expert-parallel``): each rank holds half the experts whole. Either way the partial sums are
all-reduced, and greedy tokens at 2 ranks equal 1 rank, float32 and int8 experts."""

from __future__ import annotations

import pytest

from helpers.moe_configs import save_tiny_deepseek, save_tiny_glm4_moe, save_tiny_gpt_oss, save_tiny_moe
from helpers.tp_helpers import greedy


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen2moe-e8-top4-shared", "mixtral-e4-top2"])
def test_moe_tp2_greedy_equals_tp1(variant: str, tmp_path) -> None:
    path, _ = save_tiny_moe(variant, tmp_path / variant, seed=3)
    assert greedy(path, 2) == greedy(path, 1)


@pytest.mark.slow
def test_int8_moe_tp2_equals_int8_tp1(tmp_path) -> None:
    path, _ = save_tiny_moe("qwen3moe-e8-top3", tmp_path / "m", seed=3)
    want = greedy(path, 1, quantization="int8")
    assert greedy(path, 2, quantization="int8") == want


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen2moe-e8-top4-shared", "qwen3moe-e16-top1-norm"])
def test_moe_ep2_greedy_equals_tp1(variant: str, tmp_path) -> None:
    path, _ = save_tiny_moe(variant, tmp_path / variant, seed=3)
    assert greedy(path, 2, enable_expert_parallel=True) == greedy(path, 1)


@pytest.mark.slow
def test_int8_moe_ep2_equals_int8_tp1(tmp_path) -> None:
    path, _ = save_tiny_moe("mixtral-e4-top2", tmp_path / "m", seed=3)
    assert greedy(path, 2, quantization="int8", enable_expert_parallel=True) == greedy(path, 1, quantization="int8")


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_gpt_oss_tp2_and_ep2_greedy_equal_tp1(expert_parallel: bool, tmp_path) -> None:
    """gpt-oss: each rank's heads' sinks; the expert biases split with the experts (the down bias added once)."""
    path, _ = save_tiny_gpt_oss(tmp_path / "gpt_oss", seed=3)
    assert greedy(path, 2, enable_expert_parallel=expert_parallel) == greedy(path, 1)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["v2-grouped-yarn", "v3"])
def test_deepseek_tp2_greedy_equals_tp1(variant: str, tmp_path) -> None:
    """Multi-head latent attention split by heads (queries, kv_b_proj's blocks, o_proj's columns), the latent the
    same on both ranks; experts split as for the other families."""
    path, _ = save_tiny_deepseek(variant, tmp_path / variant, seed=3)
    assert greedy(path, 2) == greedy(path, 1)


@pytest.mark.slow
def test_glm4_moe_tp2_greedy_equals_tp1(tmp_path) -> None:
    """GLM-4.5: each rank's heads reordered for partial rotary like the whole layer's; q/k norms per head."""
    path, _ = save_tiny_glm4_moe("qk-norm-grouped", tmp_path / "glm", seed=3)
    assert greedy(path, 2) == greedy(path, 1)


def test_moe_sizes_that_do_not_divide_fail_naming_them_and_ep_ranks_hold_their_experts() -> None:
    import torch

    from pagedllm.distributed import parallel_state
    from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule

    saved = parallel_state._TP
    parallel_state._TP = parallel_state.TensorParallelGroup(0, 3, "gloo")
    try:
        with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*moe intermediate_size \(32\)"):
            FusedMoE(RoutingRule(4, 2), 16, 32, dtype=torch.float32, prefix="model.layers.0.mlp.experts")
        parallel_state._TP = parallel_state.TensorParallelGroup(0, 3, "gloo", expert_parallel=True)
        with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*number of experts \(4\)"):
            FusedMoE(RoutingRule(4, 2), 16, 32, dtype=torch.float32, prefix="model.layers.0.mlp.experts")
        parallel_state._TP = parallel_state.TensorParallelGroup(1, 2, "gloo", expert_parallel=True)
        layer = FusedMoE(RoutingRule(4, 2), 16, 32, dtype=torch.float32, prefix="model.layers.0.mlp.experts")
        assert (layer.first_expert, layer.num_local_experts, tuple(layer.gate_up_proj.shape)) == (2, 2, (2, 64, 16))
        down = torch.randn(4, 16, 32)
        layer.down_proj.weight_loader(layer.down_proj, down, None)  # fused: this rank keeps experts 2 and 3
        assert torch.equal(layer.down_proj, down[2:])
        layer.down_proj.weight_loader(layer.down_proj, torch.zeros(16, 32), (0, 0))  # another rank's: skipped
        assert torch.equal(layer.down_proj, down[2:])
    finally:
        parallel_state._TP = saved


def test_int8_down_of_a_rank_has_the_codes_of_one_rank() -> None:
    """Split by columns, each rank's int8 down projection is quantized with the whole row's scale: its weights are
    the one-rank weights' columns exactly."""
    import torch

    from pagedllm.distributed import parallel_state
    from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule
    from pagedllm.model_executor.layers.quantization import get_quantization_config

    int8 = get_quantization_config("int8")
    down = torch.randn(2, 16, 64)

    def dequantized_down(rank: int, world: int) -> torch.Tensor:
        parallel_state._TP = parallel_state.TensorParallelGroup(rank, world, "gloo")
        layer = FusedMoE(RoutingRule(2, 1), 16, 64, dtype=torch.float32, quant_config=int8, prefix="m.experts")
        layer.gate_up_proj.weight_loader(layer.gate_up_proj, torch.randn(2, 128, 16), None)
        layer.down_proj.weight_loader(layer.down_proj, down, None)
        layer.process_weights_after_loading()
        assert layer._stacked is not None  # the experts' panels stacked for moe_quant_gemm
        return layer._stacked[1].expert(1).dequantize()

    saved = parallel_state._TP
    try:
        whole = dequantized_down(0, 1)
        assert not torch.equal(whole, down[1])  # really quantized
        halves = [dequantized_down(r, 2) for r in (0, 1)]
    finally:
        parallel_state._TP = saved
    assert torch.equal(torch.cat(halves, dim=1), whole)


@pytest.mark.slow
def test_gguf_q8_0_moe_ep2_equals_tp1(tmp_path) -> None:
    """A Q8_0 Qwen3-MoE GGUF: each rank keeps its experts' blocks quantized; EP=2 equals one rank."""
    from helpers.arch_configs import hf_model
    from helpers.gguf_writer import write_gguf
    from helpers.moe_configs import moe_config

    config = moe_config("qwen3moe-e16-top1-norm")
    path = write_gguf(hf_model(config, seed=3), tmp_path / "tiny-moe.Q8_0.gguf", quantized=True)
    assert greedy(path, 2, enable_expert_parallel=True) == greedy(path, 1)
