"""Tensor parallelism of MoE models through the mp executor: each rank holds a slice of every expert's intermediate
dimension (and of the shared expert's), the partial sums are all-reduced; TP=2 greedy equals TP=1, float32 and int8
experts."""

from __future__ import annotations

import pytest

from helpers.moe_configs import save_tiny_moe
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


def test_moe_intermediate_size_that_does_not_divide_fails_naming_it() -> None:
    import torch

    from pagedllm.distributed import parallel_state
    from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule

    saved = parallel_state._TP
    parallel_state._TP = parallel_state.TensorParallelGroup(0, 3, "gloo")
    try:
        with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*moe intermediate_size \(32\)"):
            FusedMoE(RoutingRule(4, 2), 16, 32, dtype=torch.float32, prefix="model.layers.0.mlp.experts")
    finally:
        parallel_state._TP = saved
