"""The Whisper model against transformers' on the same weights: a tiny random HF folder (fast), float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends import torch_encoder
from pagedllm.config import ModelConfig
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.whisper_helpers import decoder_prompt, make_tiny_whisper, reference_generate, reference_model

# Each builds engines and runs transformers' reference generate: seconds each on 2 cores.
pytestmark = pytest.mark.slow


def _features(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((80, 3000)).astype(np.float32) * 0.5


@pytest.fixture(scope="module")
def tiny_llm(tiny_whisper_dir: str) -> LLM:
    return LLM(model=tiny_whisper_dir, dtype="float32", kv_cache_memory="96MiB", max_num_batched_tokens=8192)


def test_hf_folder_resolves_as_encoder_decoder(tiny_whisper_dir: str) -> None:
    mc = resolve_model_config(ModelConfig(model=tiny_whisper_dir, dtype="float32", device="cpu"))
    assert mc.architecture == "WhisperForConditionalGeneration" and mc.is_encoder_decoder
    assert mc.max_model_len == 448 and mc.ct2_file is None
    assert mc.hf_config.no_timestamps_token_id == 50362  # from generation_config.json
    assert mc.hf_config.max_initial_timestamp_index == 50


def test_encoder_output_matches_transformers(tiny_whisper_dir: str) -> None:
    mc = resolve_model_config(ModelConfig(model=tiny_whisper_dir, dtype="float32", device="cpu"))
    ours = load_model(mc)
    ref = reference_model(mc)
    features = torch.from_numpy(np.stack([_features(0), _features(1)]))
    with torch.inference_mode():
        expected = ref.model.encoder(features).last_hidden_state
        got = ours.encode(features).view(expected.shape)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("choice", ["auto", "avx512_bf16", "off"])
def test_bf16_encoder_is_as_close_to_float32_as_transformers_bf16(tmp_path, monkeypatch, choice: str) -> None:
    """bf16 with one head of 64 dims: the encoder attention runs in the bf16 kernel this CPU has (AMX tiles or
    AVX-512 BF16 dot products, PAGEDLLM_ENCODER_ATTENTION_BF16 choosing; torch's SDPA where it has neither or the
    choice rules them out) and the encoder output errs from float32 transformers' no more than transformers' own
    bf16 encoder does."""
    monkeypatch.setenv("PAGEDLLM_ENCODER_ATTENTION_BF16", choice)
    chosen = []
    pick = torch_encoder.bf16_kernel
    monkeypatch.setattr(torch_encoder, "bf16_kernel", lambda kernels, q: chosen.append(pick(kernels, q)) or chosen[-1])
    folder = make_tiny_whisper(tmp_path / "one_head", seed=5, heads=1)
    features = torch.from_numpy(np.stack([_features(4), _features(5)]))
    configs = {dt: resolve_model_config(ModelConfig(model=folder, dtype=dt, device="cpu"))
               for dt in ("float32", "bfloat16")}
    with torch.inference_mode():
        exact = reference_model(configs["float32"]).model.encoder(features).last_hidden_state
        ref_bf16 = reference_model(configs["float32"]).to(torch.bfloat16).model.encoder(features.bfloat16())
        ref_bf16 = ref_bf16.last_hidden_state
        ours = load_model(configs["bfloat16"]).encode(features.bfloat16()).view(exact.shape)
    assert ours.dtype == torch.bfloat16
    kernels = load_cpu_kernels()
    if kernels is None:  # no C++ kernels: SDPA, never asked
        assert chosen == []
    else:
        able = kernels.encoder_attention_kernels(ours.view(-1, 1, 64))
        expected = None if choice == "off" else next((k for k in able if choice in ("auto", k) and k != "generic"),
                                                     None)
        assert chosen == [expected, expected]  # each of the two layers
    ours_err, ref_err = (ours.float() - exact).abs(), (ref_bf16.float() - exact).abs()
    assert ours_err.mean() <= 1.25 * ref_err.mean() and ours_err.max() <= 2 * ref_err.max()


def test_greedy_and_decoder_logits_match_transformers(tiny_llm: LLM, tiny_whisper_dir: str) -> None:
    mc = tiny_llm.engine.config.model
    ref = reference_model(mc)
    prompt = decoder_prompt(tiny_llm.get_tokenizer(), mc)
    features = _features(2)
    out = tiny_llm.generate({"prompt_token_ids": prompt, "audio_features": features},
                            SamplingParams(temperature=0, max_tokens=12, logprobs=0), use_tqdm=False)[0].outputs[0]
    expected = reference_generate(ref, mc, features, max_new_tokens=12)
    assert out.token_ids[:len(expected)] == expected and len(out.token_ids) >= len(expected)
    # Decoder logits: transformers teacher-forced on our tokens, against the logprobs the engine returned.
    with torch.inference_mode():
        logits = ref(input_features=torch.from_numpy(features)[None],
                     decoder_input_ids=torch.tensor([prompt + out.token_ids[:-1]])).logits[0]
    ref_logprobs = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:]
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token].logprob == pytest.approx(float(ref_logprobs[step, token]), abs=2e-4)


def test_greedy_with_timestamps_matches_transformers(tiny_llm: LLM) -> None:
    mc = tiny_llm.engine.config.model
    ref = reference_model(mc)
    prompt = decoder_prompt(tiny_llm.get_tokenizer(), mc, timestamps=True)
    ts_begin = mc.hf_config.no_timestamps_token_id + 1
    features = _features(3)
    out = tiny_llm.generate({"prompt_token_ids": prompt, "audio_features": features},
                            SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference_generate(ref, mc, features, timestamps=True, max_new_tokens=20)
    stamps = [t for t in out.token_ids if t >= ts_begin]
    assert len(stamps) >= 4 and stamps == sorted(stamps)  # pairs, non-decreasing: the rules were exercised
