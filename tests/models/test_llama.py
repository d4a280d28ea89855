"""Our Llama vs transformers' on tiny random models: full prefill, chunked prefill and paged decodes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model_executor.layers.attention import bind_kv_caches
from pagedllm.model_executor.loader import load_model, resolve_model_config
from pagedllm.model_executor.models.llama import LlamaForCausalLM

from helpers.model_helpers import make_kv_caches, make_model_kv_caches, make_tiny_llama, paged_step, prefill_logits

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
VARIANTS = {
    "tied": {},
    "llama3_untied": {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False},
    "bias_headdim": {"attention_bias": True, "mlp_bias": True, "head_dim": 32, "num_key_value_heads": 1},
}
FP32_ATOL = 1e-4
# bf16 keeps ~3 significant digits; over 2 layers our op order differs from transformers', so compare
# against the fp32 reference with a tolerance of 3% of the logit range.
BF16_REL_TOL = 3e-2


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_llama(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _token_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _load(path: str, dtype: str) -> LlamaForCausalLM:
    mc = resolve_model_config(ModelConfig(model=path, dtype=dtype))
    model = load_model(mc, torch.device("cpu"))
    assert isinstance(model, LlamaForCausalLM)
    return model


def test_prefill_matches_transformers_fp32(variant) -> None:
    path, hf = variant
    model = _load(path, "float32")
    # On CPU the fp32 matmuls run on weights repacked for the C++ kernel; the logits must not notice.
    if load_cpu_kernels() is not None:
        assert model.model.layers[0].mlp.gate_up_proj.packed.describe() == "float32"  # Float32Panels
    ids = _token_ids(20, seed=1)
    ours = prefill_logits(model, ids, block_size=4)
    assert ours.dtype == torch.float32 and ours.shape == (20, 256)
    torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=FP32_ATOL, rtol=0)


def test_prefill_matches_transformers_bf16(variant) -> None:
    path, hf = variant
    model = _load(path, "bf16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = _token_ids(20, seed=2)
    ref = _hf_logits(hf, ids)
    ours = prefill_logits(model, ids, block_size=4)
    tol = BF16_REL_TOL * (ref.max() - ref.min()).item()
    assert (ours - ref).abs().max().item() < tol
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_chunked_prefill_and_batched_decode_match_transformers(variant) -> None:
    """Request A: two prefill chunks, then decodes; request B joins mid-way, sharing steps with A."""
    path, hf = variant
    model = _load(path, "float32")
    block_size = 4
    bind_kv_caches(model, make_kv_caches(model.config, num_blocks=12, block_size=block_size))
    a, b = _token_ids(11, seed=3), _token_ids(7, seed=4)
    table_a, table_b = [5, 2, 9], [1, 11]  # scattered, non-contiguous blocks
    got_a, got_b = [], []
    got_a.append(paged_step(model, [a[0:5]], [5], [table_a], block_size))
    got_a.append(paged_step(model, [a[5:9]], [9], [table_a], block_size))
    # Mixed step: A decodes (first, as the metadata requires) while B runs its whole prompt but one token.
    out = paged_step(model, [a[9:10], b[0:6]], [10, 6], [table_a, table_b], block_size)
    got_a.append(out[:1])
    got_b.append(out[1:])
    out = paged_step(model, [a[10:11], b[6:7]], [11, 7], [table_a, table_b], block_size)
    got_a.append(out[:1])
    got_b.append(out[1:])
    torch.testing.assert_close(torch.cat(got_a), _hf_logits(hf, a), atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), _hf_logits(hf, b), atol=FP32_ATOL, rtol=0)


def test_chunked_bf16_prefill_matches_transformers(variant) -> None:
    """bf16, a prompt longer than the CPU kernel's bf16 limits run whole and as two chunks (the second, 70 tokens over
    50 of context: with head dim 32 on a CPU with AVX-512 BF16 and no AMX tiles, the causal bf16 kernel takes both
    the whole prompt and that chunk; elsewhere SDPA): both within bf16 rounding of transformers' float32 logits."""
    path, hf = variant
    model = _load(path, "bf16")
    ids = _token_ids(120, seed=5)
    ref = _hf_logits(hf, ids)
    tol = BF16_REL_TOL * (ref.max() - ref.min()).item()
    whole = prefill_logits(model, ids, block_size=16)
    bind_kv_caches(model, make_model_kv_caches(model, num_blocks=9, block_size=16))
    table = [3, 1, 7, 5, 2, 8, 4, 6]  # scattered blocks
    chunked = torch.cat([paged_step(model, [ids[:50]], [50], [table], 16),
                         paged_step(model, [ids[50:]], [120], [table], 16)])
    for ours in (whole, chunked):
        assert (ours - ref).abs().max().item() < tol
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_load_weights_rejects_incomplete_checkpoint(tiny_llama_dir: str) -> None:
    mc = resolve_model_config(ModelConfig(model=tiny_llama_dir, dtype="float32"))
    model = LlamaForCausalLM(mc.hf_config, torch.float32)
    weights = [("model.embed_tokens.weight", torch.zeros(256, 64))]
    with pytest.raises(ValueError, match="missing"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])
