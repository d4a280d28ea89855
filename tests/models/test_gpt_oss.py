"""gpt-oss against transformers on a tiny random model: attention sinks, alternating sliding-window (8 tokens) and
full layers, router bias with top-k then softmax, expert biases and the clamped SwiGLU. Whole prompts, chunked
prefill with paged decodes, greedy tokens through the engine batched and alone; the features the comparison
relies on do change the reference's output (so the match is not vacuous); MXFP4 checkpoints are refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.model_helpers import chunked_prefill_and_decodes, prefill_logits
from helpers.moe_configs import bf16_experts_form, save_tiny_gpt_oss

ATOL = 2e-4
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path, hf = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32"))
    assert mc.architecture == "GptOssForCausalLM"
    return path, hf, load_model(mc, torch.device("cpu"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_matches_transformers(tiny) -> None:
    _, hf, model = tiny
    ids = _ids(40, seed=1)  # 5x the window
    torch.testing.assert_close(prefill_logits(model, ids, block_size=4), _hf_logits(hf, ids), atol=ATOL, rtol=0)
    kinds = [layer.self_attn.attn.spec.kind for layer in model.model.layers]
    assert kinds == ["sliding", "causal", "sliding"]
    assert all(layer.self_attn.attn.sinks is not None for layer in model.model.layers)
    assert len([m for m in model.modules() if isinstance(m, FusedMoE)]) == 3


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    """Request A: prefill in two chunks, then decodes; B joins mid-way (mixed batches, decodes batched)."""
    _, hf, model = tiny
    a, b = _ids(30, seed=2), _ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, _hf_logits(hf, b), atol=ATOL, rtol=0)


def test_the_compared_features_change_the_reference(tiny) -> None:
    """Sinks, the window, the SwiGLU clamp and the expert biases each move transformers' logits, so matching them
    checks each one."""
    _, hf, _ = tiny
    ids = _ids(30, seed=4)
    want = _hf_logits(hf, ids)
    layers = hf.model.layers
    changes = {
        "sinks": [(layer.self_attn.sinks, torch.full_like(layer.self_attn.sinks, -1e4)) for layer in layers],
        "expert biases": [(layer.mlp.experts.down_proj_bias, torch.zeros_like(layer.mlp.experts.down_proj_bias))
                          for layer in layers],
    }
    for what, swaps in changes.items():
        kept = [p.detach().clone() for p, _ in swaps]
        with torch.no_grad():
            for p, new in swaps:
                p.copy_(new)
            moved = (_hf_logits(hf, ids) - want).abs().max()
            for (p, _), old in zip(swaps, kept, strict=True):
                p.copy_(old)
        assert moved > 1e-2, what
    for layer in layers:
        layer.mlp.experts.limit = 1e4
    moved = (_hf_logits(hf, ids) - want).abs().max()
    for layer in layers:
        layer.mlp.experts.limit = hf.config.swiglu_limit
    assert moved > 1e-2, "swiglu clamp"
    hf.config.sliding_window = 64  # longer than the prompt: every layer sees everything
    try:
        moved = (_hf_logits(hf, ids) - want).abs().max()
    finally:
        hf.config.sliding_window = 8
    assert moved > 1e-2, "sliding window"
    torch.testing.assert_close(_hf_logits(hf, ids), want, atol=0, rtol=0)


def test_engine_greedy_equals_transformers_generate_batched_and_alone(tiny) -> None:
    """Through the engine: sliding layers in their own KV cache group (blocks past the window freed)."""
    from pagedllm import LLM, SamplingParams

    path, hf, _ = tiny
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=32)
    try:
        prompts = [_ids(n, seed=10 + n) for n in (5, 23, 37)]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, batched, strict=True):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)[0, len(prompt):].tolist()
            assert list(out.outputs[0].token_ids) == ref
            alone = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            assert list(alone.outputs[0].token_ids) == ref
    finally:
        llm.engine.core.close()


def test_int8_and_bfloat16_experts_close_to_float(tiny, tmp_path) -> None:
    """The per-expert layers with biases (a quantization scheme's, bf16's)."""
    path, hf, _ = tiny
    ids = _ids(24, seed=5)
    want = _hf_logits(hf, ids)
    for kwargs, tol in ((dict(dtype="float32", quantization="int8"), 0.05), (dict(dtype="bfloat16"), 0.1)):
        model = load_model(resolve_model_config(ModelConfig(model=path, **kwargs)))
        form = next(m for m in model.modules() if isinstance(m, FusedMoE)).describe()
        assert ("stacked (moe_quant_gemm)" if "quantization" in kwargs else bf16_experts_form()) in form
        got = prefill_logits(model, ids).float()
        assert (got - want).abs().max() < tol * want.abs().max(), kwargs
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_mxfp4_experts_are_refused_naming_why(tiny, tmp_path) -> None:
    path, _, _ = tiny
    tensors = load_file(f"{path}/model.safetensors")
    w = tensors.pop("model.layers.0.mlp.experts.gate_up_proj")
    tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] = w.to(torch.uint8)
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        src = f"{path}/{f}"
        if __import__("os").path.exists(src):
            (folder / f).write_bytes(open(src, "rb").read())
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="gate_up_proj_blocks: gpt-oss's MXFP4 expert weights are not supported"):
        load_model(resolve_model_config(ModelConfig(model=str(folder), dtype="float32")))
