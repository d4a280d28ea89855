"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on tiny random models with 4-16
experts, top-1 to top-4, with and without renormalisation, a shared expert and a dense layer: whole prompts,
chunked prefill + paged decodes, greedy tokens through the engine (transformers' ``generate``; a batch of
mixed-length prompts equals each alone); the output follows the routing; fused-expert checkpoints load; refusals
name what is not supported."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.model_helpers import chunked_prefill_and_decodes, prefill_logits
from helpers.moe_configs import MOE_VARIANTS, save_tiny_moe

ATOL = 2e-4
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=list(MOE_VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path, hf = save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param))
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32"))
    assert mc.architecture == MOE_VARIANTS[request.param][0]
    return request.param, path, hf, load_model(mc, torch.device("cpu"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _moe_layers(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_prefill_matches_transformers(tiny) -> None:
    variant, _, hf, model = tiny
    ids = _ids(40, seed=1)
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), _hf_logits(hf, ids), atol=ATOL, rtol=0)
    expected_moe = 2 if variant.startswith("qwen2moe") else len(hf.model.layers)  # qwen2moe: layer 1 is dense
    assert len(_moe_layers(model)) == expected_moe


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    """Request A: prefill in two chunks, then decodes; B joins mid-way and shares the steps (mixed batches)."""
    _, _, hf, model = tiny
    a, b = _ids(30, seed=2), _ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, _hf_logits(hf, b), atol=ATOL, rtol=0)


def _with_tensors(path: str, dest, change) -> str:
    """A copy of the HF folder ``path`` at ``dest`` whose safetensors went through ``change(dict)``."""
    shutil.copytree(path, dest)
    tensors = load_file(f"{path}/model.safetensors")
    change(tensors)
    save_file(tensors, f"{dest}/model.safetensors", metadata={"format": "pt"})
    return str(dest)


def test_output_follows_the_routing(tiny, tmp_path) -> None:
    """Swapping two experts' tensors in the checkpoint changes the logits; swapping the router's rows for them too
    gives the same model back."""
    _, path, _, model = tiny
    ids = _ids(24, seed=4)
    want = prefill_logits(model, ids)
    block = next(n.rsplit(".experts.", 1)[0] for n in load_file(f"{path}/model.safetensors") if ".experts.0." in n)

    def swap_experts(tensors: dict) -> None:
        for name in [n for n in tensors if n.startswith(f"{block}.experts.0.")]:
            other = name.replace(".experts.0.", ".experts.1.")
            tensors[name], tensors[other] = tensors[other], tensors[name]

    def swap_experts_and_router(tensors: dict) -> None:
        swap_experts(tensors)
        router = tensors[f"{block}.gate.weight"]  # [E, H]: expert e's logit is row e
        order = torch.arange(router.shape[0])
        order[:2] = torch.tensor([1, 0])
        tensors[f"{block}.gate.weight"] = router[order]

    def logits(change, name: str) -> torch.Tensor:
        folder = _with_tensors(path, tmp_path / name, change)
        return prefill_logits(load_model(resolve_model_config(ModelConfig(model=folder, dtype="float32"))), ids)

    assert (logits(swap_experts, "experts") - want).abs().max() > 1e-2
    torch.testing.assert_close(logits(swap_experts_and_router, "both"), want, atol=1e-5, rtol=0)


def test_engine_greedy_equals_transformers_generate_batched_and_alone(tiny) -> None:
    from pagedllm import LLM, SamplingParams

    _, path, hf, _ = tiny
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=64)
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


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path) -> None:
    """A checkpoint storing each layer's experts as 3D tensors ([E, 2I, H] gate|up, [E, H, I] down) loads to the
    same model."""
    path, hf = save_tiny_moe("mixtral-e4-top2", tmp_path / "per_expert")
    fused_dir = tmp_path / "fused"
    hf.save_pretrained(fused_dir)
    tensors = load_file(fused_dir / "model.safetensors")
    config = json.loads((fused_dir / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        experts = range(config["num_local_experts"])
        gate = [tensors.pop(f"{pre}.{e}.w1.weight") for e in experts]
        up = [tensors.pop(f"{pre}.{e}.w3.weight") for e in experts]
        down = [tensors.pop(f"{pre}.{e}.w2.weight") for e in experts]
        tensors[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        tensors[f"{pre}.down_proj"] = torch.stack(down)
    save_file(tensors, fused_dir / "model.safetensors", metadata={"format": "pt"})
    ids = _ids(20, seed=5)
    models = [load_model(resolve_model_config(ModelConfig(model=str(p), dtype="float32"))) for p in (path, fused_dir)]
    torch.testing.assert_close(prefill_logits(models[1], ids), prefill_logits(models[0], ids), atol=0, rtol=0)


def test_unsupported_moe_checkpoints_are_refused_naming_why(tmp_path) -> None:
    from pagedllm.model_executor.models.registry import get_model_cls

    from helpers.moe_configs import moe_config

    cfg = moe_config("qwen3moe-e8-top3")
    cfg.n_group = 4  # DeepSeek-style grouped routing
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: MoE routing setting n_group=4 is not supported"):
        get_model_cls(["Qwen3MoeForCausalLM"])(cfg)
    path, _ = save_tiny_moe("qwen3moe-e8-top3", tmp_path / "odd")
    tensors = load_file(f"{path}/model.safetensors")
    tensors["model.layers.0.mlp.experts.3.w_in.weight"] = tensors.pop("model.layers.0.mlp.experts.3.up_proj.weight")
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.3\.w_in\.weight"):
        load_model(resolve_model_config(ModelConfig(model=path, dtype="float32")))


@pytest.mark.parametrize(("scheme", "max_error", "same_argmax"), [("int8", 0.05, 0.9), ("fp8", 0.1, 0.8),
                                                                   ("int4", 0.2, 0.6)])
def test_quantized_experts_close_to_float(scheme: str, max_error: float, same_argmax: float, tmp_path) -> None:
    path, hf = save_tiny_moe("qwen2moe-e8-top4-shared", tmp_path / "m")
    model = load_model(resolve_model_config(ModelConfig(model=path, dtype="float32", quantization=scheme)))
    layer = _moe_layers(model)[0]
    assert layer.gate_up_proj.numel() == 0  # the float stacks are gone: packed experts only
    # every expert packed alike: stacked, one C++ call per projection (moe_quant_gemm)
    assert layer.describe().startswith(scheme) and layer.describe().endswith("stacked (moe_quant_gemm)")
    ids = _ids(30, seed=6)
    got, want = prefill_logits(model, ids), _hf_logits(hf, ids)
    assert (got - want).abs().max() < max_error * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= same_argmax


@pytest.mark.parametrize("variant", ["mixtral-e4-top2", "qwen2moe-e8-top4-shared"])
def test_bfloat16_experts_close_to_float(variant: str, tmp_path) -> None:
    """bf16 experts run the dense layers' bf16 form per expert (on the CPU); logits close to float32 transformers."""
    path, hf = save_tiny_moe(variant, tmp_path / "m")
    model = load_model(resolve_model_config(ModelConfig(model=path, dtype="bfloat16")))
    assert all("bfloat16" in m.describe() for m in _moe_layers(model))
    ids = _ids(30, seed=6)
    got, want = prefill_logits(model, ids).float(), _hf_logits(hf, ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("variant", ["qwen3moe-e8-top3", "qwen2moe-e8-top4-shared", "mixtral-e4-top2"])
def test_moe_gguf_matches_transformers(variant: str, qtype: str, tmp_path) -> None:
    """A tiny Qwen3-MoE / Qwen2-MoE / Mixtral (llama architecture, q/k rows permuted) written as GGUF (experts as
    ``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp`` F32, Qwen2-MoE's shared expert as ``*_shexp``) loads
    with its routing settings from the metadata and matches transformers; Q8_0: the blocks stay quantized, the
    experts' too, and the reference holds the file's Q8_0 values."""
    from helpers.arch_configs import hf_model
    from helpers.gguf_writer import quantize_roundtrip, write_gguf
    from helpers.moe_configs import moe_config

    config = moe_config(variant)
    config.mlp_only_layers = []  # llama.cpp's qwen2moe has no dense layers
    hf = hf_model(config)
    if qtype == "Q8_0":
        quantize_roundtrip(hf)
    path = write_gguf(hf, tmp_path / f"tiny-moe.{qtype}.gguf", quantized=qtype == "Q8_0")
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32"))
    assert mc.architecture == MOE_VARIANTS[variant][0]
    assert mc.quantization == ("gguf" if qtype == "Q8_0" else "none")
    cfg = mc.hf_config
    keys = ("num_local_experts", "num_experts_per_tok", "intermediate_size") if variant.startswith("mixtral") \
        else ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    for key in keys:
        assert getattr(cfg, key) == getattr(config, key), key
    model = load_model(mc)
    if qtype == "Q8_0":  # the experts' blocks stay quantized: stacked per projection where all of them are; a down
        # projection whose rows are not whole Q8_0 blocks (32) stays float in the file, and its experts run one by one
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        form = "stacked (moe_quant_gemm)" if inter % 32 == 0 else "per expert"
        assert all(m.describe() == f"gguf Q8_0 {form}" for m in _moe_layers(model))
    ids = _ids(30, seed=7)
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_old_per_expert_mixtral_gguf_is_refused_naming_why(tmp_path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "old-mixtral.gguf"), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 64), (writer.add_head_count, 4),
                       (writer.add_feed_forward_length, 96), (writer.add_context_length, 256),
                       (writer.add_expert_count, 4), (writer.add_expert_used_count, 2)):
        add(value)
    writer.add_tensor("token_embd.weight", torch.zeros(256, 64).numpy())
    writer.add_tensor("blk.0.ffn_gate.0.weight", torch.zeros(96, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="without ffn_gate_exps tensors .an older per-expert layout. is not supported"):
        resolve_model_config(ModelConfig(model=str(tmp_path / "old-mixtral.gguf")))


@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_fp8_checkpoint_experts_equal_their_dequantized_model(tmp_path, scheme: str) -> None:
    """An fp8 release's experts (``experts.{e}.gate_proj.weight`` float8 with ``weight_scale_inv`` blocks or
    ``weight_scale`` rows) load as the scheme's layers, their bytes unchanged, stacked for one call per projection,
    and compute what the dequantized float model does."""
    from pathlib import Path

    from helpers.fp8_checkpoints import fp8_checkpoint

    src, _ = save_tiny_moe("qwen2moe-e8-top4-shared", tmp_path / "float")
    dequantized = fp8_checkpoint(Path(src), tmp_path / "fp8", scheme)
    assert any(".experts.3.down_proj." in n for n in dequantized)
    float_dir = tmp_path / "dequantized"
    shutil.copytree(src, float_dir)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(float_dir / "model.safetensors"),
              metadata={"format": "pt"})
    model = load_model(resolve_model_config(ModelConfig(model=str(tmp_path / "fp8"), dtype="float32")))
    layer = _moe_layers(model)[0]
    assert layer.describe() == f"fp8 {'block 16x16' if scheme == 'block' else 'per-channel'} stacked (moe_quant_gemm)"
    ref = load_model(resolve_model_config(ModelConfig(model=str(float_dir), dtype="float32")))
    ids = _ids(30, seed=7)
    torch.testing.assert_close(prefill_logits(model, ids), prefill_logits(ref, ids), atol=2e-4, rtol=1e-4)


def test_fp8_checkpoint_experts_without_scales_fail_naming_the_parameter(tmp_path) -> None:
    from pathlib import Path

    from helpers.fp8_checkpoints import LINEAR_NAMES, fp8_checkpoint

    src, _ = save_tiny_moe("mixtral-e4-top2", tmp_path / "float")
    fp8_checkpoint(Path(src), tmp_path / "fp8", "block", linear_names=(*LINEAR_NAMES, "w1", "w2", "w3"))
    tensors = load_file(f"{tmp_path}/fp8/model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight_scale_inv"]
    save_file(tensors, f"{tmp_path}/fp8/model.safetensors", metadata={"format": "pt"})
    missing = r"missing from the checkpoint: .*layers\.1\.mlp\.experts\.gate_up_proj_scale_inv"
    with pytest.raises(ValueError, match=missing):
        load_model(resolve_model_config(ModelConfig(model=str(tmp_path / "fp8"), dtype="float32")))
