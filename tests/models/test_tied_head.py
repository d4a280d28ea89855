"""The tied LM head: its own packed copy where linear weights are repacked (float32 panels; bf16 in oneDNN's
layout where the CPU has native bf16), the embedding rows elsewhere; logits equal the rows' either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.platforms import platform_for

from helpers.model_helpers import tiny_llama_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_head_copy_where_weights_are_repacked(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(), dtype=dtype)
    with torch.no_grad():
        model.embedding().weight.normal_()
    model.process_weights_after_loading()
    repacks = platform_for("cpu").packs_linear_weights(dtype)
    assert (model._tied_head is not None) == repacks
    if dtype == torch.float32:
        assert repacks, "the C++ CPU kernels must build on the test machine"
    hidden = torch.randn(3, model.config.hidden_size).to(dtype)
    ref = F.linear(hidden.float(), model.embedding().weight.float())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(model.compute_logits(hidden), ref, **tol)
    out = torch.full_like(ref, float("nan"))  # the runner's reused float32 logits buffer
    logits = model.compute_logits(hidden, out=out)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, **tol)
