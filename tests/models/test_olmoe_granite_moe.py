"""OLMoE and Granite-MoE against transformers on tiny random models: whole prompts, chunked prefill with paged
decodes, greedy tokens through the engine batched and alone. OLMoE: q/k norms over all heads, clip_qkv; Granite-MoE:
top-k then softmax, fused ``input_linear`` / ``output_linear`` experts, every multiplier away from 1."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.model_helpers import chunked_prefill_and_decodes, prefill_logits
from helpers.moe_configs import granite_moe_config, olmoe_config, save_tiny

ATOL = 2e-4
NEW_TOKENS = 8
CONFIGS = {"olmoe": olmoe_config, "granitemoe": granite_moe_config}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path, hf = save_tiny(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32"))
    return request.param, path, hf, load_model(mc, torch.device("cpu"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_matches_transformers(tiny) -> None:
    _, _, hf, model = tiny
    ids = _ids(40, seed=1)
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), _hf_logits(hf, ids), atol=ATOL, rtol=0)
    assert len([m for m in model.modules() if isinstance(m, FusedMoE)]) == len(hf.model.layers)


def test_chunked_prefill_and_decodes_match_transformers(tiny) -> None:
    _, _, hf, model = tiny
    a, b = _ids(30, seed=2), _ids(21, seed=3)
    got_a, got_b = chunked_prefill_and_decodes(model, a, b)
    torch.testing.assert_close(got_a, _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, _hf_logits(hf, b), atol=ATOL, rtol=0)


def test_the_family_settings_change_the_reference(tiny, tmp_path) -> None:
    """Each setting the match relies on moves transformers' logits (a model built without it differs)."""
    variant, _, hf, _ = tiny
    ids = _ids(24, seed=4)
    want = _hf_logits(hf, ids)
    plain = {"olmoe": [dict(clip_qkv=None)],
             "granitemoe": [dict(embedding_multiplier=1.0), dict(attention_multiplier=16 ** -0.5),
                            dict(residual_multiplier=1.0), dict(logits_scaling=1.0)]}[variant]
    for change in plain:
        _, other = save_tiny(CONFIGS[variant](**change), tmp_path / str(len(list(tmp_path.iterdir()))))
        assert (_hf_logits(other, ids) - want).abs().max() > 1e-2, change


def test_engine_greedy_equals_transformers_generate_batched_and_alone(tiny) -> None:
    from pagedllm import LLM, SamplingParams

    _, path, hf, _ = tiny
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=32)
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


def test_olmoe_under_tensor_parallelism_is_refused_naming_why() -> None:
    from pagedllm.distributed import parallel_state
    from pagedllm.model_executor.models.moe import OlmoeForCausalLM

    saved = parallel_state._TP
    parallel_state._TP = parallel_state.TensorParallelGroup(0, 2, "gloo")
    try:
        with pytest.raises(ValueError, match="q/k norms over all heads together are not implemented under tensor"):
            OlmoeForCausalLM(olmoe_config())
    finally:
        parallel_state._TP = saved
