"""Rope scaling vs transformers on tiny random models: Phi-3 LongRoPE ("longrope" / "su": short factors up to
``original_max_position_embeddings``, long ones beyond, and the attention factor), and YaRN."""

from __future__ import annotations

import inspect

import pytest
import torch

from pagedllm.model_executor.layers.attention import bind_kv_caches
from pagedllm.model_executor.models.llama import Phi3ForCausalLM, Qwen2ForCausalLM

from helpers.arch_configs import hf_model
from helpers.model_helpers import make_model_kv_caches, paged_step, prefill_logits

ORIGINAL = 32  # original_max_position_embeddings of the tiny models: prompts go on both sides of it
ATOL = 2e-4


def _longrope_config():
    import transformers as tf

    half = 8  # head_dim 16 -> 8 factors
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.15 * i for i in range(half)],
            "long_factor": [1.0 + 1.7 * i for i in range(half)]}
    return tf.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         original_max_position_embeddings=ORIGINAL, rope_parameters=rope, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                         architectures=["Phi3ForCausalLM"])


def _ours(cls, hf):
    import copy

    model = cls(copy.deepcopy(hf.config), torch.float32)
    model.load_weights(hf.state_dict().items())
    model.eval()
    for module in list(model.modules()):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def longrope_pair():
    hf = hf_model(_longrope_config())
    assert hf.model.rotary_emb.attention_scaling > 1.0  # max 128 / original 32: the factor is in play
    return hf, _ours(Phi3ForCausalLM, hf)


@pytest.mark.parametrize("length", [ORIGINAL - 7, ORIGINAL, ORIGINAL + 1, 90])
def test_longrope_prefill_matches_transformers(longrope_pair, length: int) -> None:
    """Shorter than the original context: short factors; longer: long factors on every position."""
    hf, ours = longrope_pair
    ids = _ids(length, seed=length)
    torch.testing.assert_close(prefill_logits(ours, ids, block_size=8), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_longrope_short_and_long_requests_in_one_step(longrope_pair) -> None:
    """Each request picks its own table: a long and a short prompt batched together match each alone."""
    hf, ours = longrope_pair
    bs = 8
    bind_kv_caches(ours, make_model_kv_caches(ours, num_blocks=24, block_size=bs))
    a, b = _ids(50, seed=5), _ids(20, seed=6)
    out = paged_step(ours, [a, b], [50, 20], [list(range(1, 8)), list(range(8, 11))], bs)
    torch.testing.assert_close(out[:50], _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(out[50:], _hf_logits(hf, b), atol=ATOL, rtol=0)


def test_longrope_decode_across_the_boundary_matches_transformers_cache(longrope_pair) -> None:
    """Prefill below the original length, then decodes past it: like transformers with its KV cache, the
    cached keys keep their short rotation and each new token is rotated by the set its step calls for."""
    hf, ours = longrope_pair
    bs = 8
    bind_kv_caches(ours, make_model_kv_caches(ours, num_blocks=8, block_size=bs))
    ids = _ids(ORIGINAL + 4, seed=9)
    prompt = ORIGINAL - 3
    table = list(range(1, 7))
    got = [paged_step(ours, [ids[:prompt]], [prompt], [table], bs)[-1:]]
    for pos in range(prompt, len(ids)):
        got.append(paged_step(ours, [ids[pos:pos + 1]], [pos + 1], [table], bs))
    # transformers 5.x names the KV cache `cache` (argument and output), 4.x `past_key_values`.
    cache = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(torch.tensor([ids[:prompt]]), use_cache=True)
        want, past = [out.logits[0, -1:]], out[cache]
        for pos in range(prompt, len(ids)):
            out = hf(torch.tensor([[ids[pos]]]), use_cache=True, position_ids=torch.tensor([[pos]]), **{cache: past})
            want.append(out.logits[0])
            past = out[cache]
    torch.testing.assert_close(torch.cat(got), torch.cat(want).float(), atol=ATOL, rtol=0)


def test_su_is_longrope_and_factor_count_is_checked() -> None:
    hf = hf_model(_longrope_config())
    ours = _ours(Phi3ForCausalLM, hf)
    ids = _ids(50, seed=3)
    cfg = _longrope_config()
    cfg.rope_parameters["rope_type"] = "su"  # the older name of the same scheme
    su = Phi3ForCausalLM(cfg, torch.float32)
    assert torch.equal(su.model.rotary_emb.cos_sin_cache, ours.model.rotary_emb.cos_sin_cache)
    with pytest.raises(ValueError, match="longrope: 3 factors"):
        bad = _longrope_config()
        bad.rope_parameters["short_factor"] = [1.0, 1.0, 1.0]
        Phi3ForCausalLM(bad, torch.float32)
    assert prefill_logits(ours, ids).shape == (50, 256)


def test_yarn_matches_transformers() -> None:
    import transformers as tf

    cfg = tf.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": ORIGINAL},
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Qwen2ForCausalLM"])
    hf = hf_model(cfg)
    assert hf.model.rotary_emb.attention_scaling > 1.0
    ours = _ours(Qwen2ForCausalLM, hf)
    ids = _ids(80, seed=4)
    torch.testing.assert_close(prefill_logits(ours, ids, block_size=8), _hf_logits(hf, ids), atol=ATOL, rtol=0)
