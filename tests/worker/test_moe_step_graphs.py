"""MoE models decode through CPU step graphs when their layers are float32 experts on the C++ kernels (routing,
gather, experts, weighted sum: ``moe_route.cpp``, ``moe_gemm.cpp``): the graphs record, and greedy tokens equal the
eager engine's and transformers' ``generate`` (batched, and alone: the size-1 graph). Qwen2-MoE's gated shared
expert is added in the same C++ combine."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from helpers.moe_configs import save_tiny_moe

NEW_TOKENS = 8


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                use_tqdm=False)]


@pytest.mark.parametrize("variant,graphs", [("mixtral-e4-top2", True), ("qwen2moe-e8-top4-shared", True),
                                            ("qwen3moe-e8-top3", True)])  # per-head q/k norms in place (C++)
def test_moe_decode_step_graphs_equal_eager_and_transformers(variant: str, graphs: bool, tmp_path) -> None:
    path, hf = save_tiny_moe(variant, tmp_path / variant)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 19, 9)]
    runs = {}
    for eager in (True, False):
        llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=4, enforce_eager=eager)
        try:
            recorded = llm.engine.core.worker.runner.decode_graphs is not None
            assert recorded == (graphs and not eager)
            runs[eager] = _greedy(llm, prompts)
            assert _greedy(llm, prompts[:1]) == runs[eager][:1]  # batch 1: the size-1 graph
        finally:
            llm.engine.core.close()
    assert runs[False] == runs[True]
    for prompt, got in zip(prompts, runs[False], strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, len(prompt):].tolist()
        assert got == want


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_moe_decodes_through_step_graphs(quantization: str, tmp_path) -> None:
    """Quantized experts stacked for ``moe_quant_gemm``: the whole MoE layer is kernel calls, so decode steps record
    graphs, and greedy tokens equal the eager engine's, batched and alone."""
    path, _ = save_tiny_moe("qwen2moe-e8-top4-shared", tmp_path / "m")
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 8)]
    runs = {}
    for eager in (True, False):
        llm = LLM(model=path, dtype="float32", quantization=quantization, kv_cache_memory="8MiB", max_num_seqs=4,
                  enforce_eager=eager)
        try:
            runner = llm.engine.core.worker.runner
            assert (runner.decode_graphs is not None) == (not eager)
            assert all("stacked (moe_quant_gemm)" in m.describe() for m in runner.model.modules()
                       if hasattr(m, "routes_in_kernels"))
            runs[eager] = _greedy(llm, prompts)
            assert _greedy(llm, prompts[:1]) == runs[eager][:1]
        finally:
            llm.engine.core.close()
    assert runs[False] == runs[True]

