"""Whisper requests through the engine like every request: continuous batching, the KV cache groups, bad input,
allowed_token_ids, sampling, and the engine-process boundary (a tiny random HF Whisper folder)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.core_messages import EngineCoreRequest, RequestType, decode, encode
from pagedllm.engine.encoder_inputs import pack_encoder_input, unpack_encoder_input

from helpers.model_helpers import make_tiny_llama

SOT, NO_TIMESTAMPS = 50257, 50362  # tiny.en's <|startoftranscript|>, <|notimestamps|>
PROMPT = [SOT, NO_TIMESTAMPS]


def _features(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((80, 3000)).astype(np.float32) * 0.5


@pytest.fixture(scope="module")
def llm(tiny_whisper_dir: str) -> LLM:
    return LLM(model=tiny_whisper_dir, dtype="float32", kv_cache_memory="64MiB")


def _run(llm: LLM, prompts: list[dict], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_sixteen_concurrent_requests_equal_each_alone_and_free_every_block(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = [{"prompt_token_ids": PROMPT, "audio_features": _features(i)} for i in range(16)]
    alone = [_run(llm, [p], params)[0] for p in prompts[:4]]
    runner = llm.engine.core.worker.runner
    runs_before = runner.encoder_decoder.num_encoder_runs
    together = _run(llm, prompts, params)
    assert together[:4] == alone
    assert len({tuple(t) for t in together}) > 1  # different audio, different outputs: no wrong sharing
    assert runner.encoder_decoder.num_encoder_runs - runs_before == 16
    kv = llm.engine.core.scheduler.kv
    assert kv.usage == 0.0 and all(g.pool.usage == 0.0 for g in kv.groups) and len(kv.groups) == 2
    # The same decoder prompt with other audio: no prefix-cache hit can hand it the first request's blocks.
    assert llm.engine.config.cache.enable_prefix_caching is False


@pytest.mark.slow
def test_bad_prompts_and_params_name_the_problem(llm: LLM, tmp_path: Path, tiny_whisper_dir: str) -> None:
    with pytest.raises(ValueError, match="audio_features.*transcribes audio"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="audio_features.*expected shape"):
        llm.generate({"prompt_token_ids": PROMPT, "audio_features": np.zeros((80, 100), np.float32)},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 99999 is out of range"):
        llm.generate({"prompt_token_ids": PROMPT, "audio_features": _features(0)},
                     SamplingParams(allowed_token_ids=[5, 99999]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    llama = make_tiny_llama(tmp_path / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # any fast tokenizer will do for a text model
        shutil.copyfile(Path(tiny_whisper_dir) / name, Path(llama) / name)
    text_llm = LLM(model=llama, dtype="float32", kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="audio_features.*text model"):
        text_llm.generate({"prompt_token_ids": [1, 2, 3], "audio_features": _features(0)}, use_tqdm=False)
    assert llm.engine.core.scheduler.kv.usage == 0.0


@pytest.mark.slow
def test_allowed_token_ids_choose_among_them(llm: LLM) -> None:
    """Language detection's shape: one step from [SOT] over a few tokens, with their logprobs."""
    allowed = [50258, 50259, 50260, 50261]
    out = llm.generate({"prompt_token_ids": [SOT], "audio_features": _features(5)},
                       SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed, logprobs=4),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.token_ids[0] in allowed
    # Logprobs are the model's own (before any stage): the pick is the most likely allowed token, not the top one.
    raw = llm.generate({"prompt_token_ids": [SOT], "audio_features": _features(5)},
                       SamplingParams(temperature=0, max_tokens=1, logprobs=20, prompt_logprobs=None),
                       use_tqdm=False)[0].outputs[0]
    assert raw.token_ids[0] not in allowed  # unconstrained, the model picks something else
    assert out.logprobs[0][out.token_ids[0]].rank > 1


@pytest.mark.slow
def test_temperature_sampling_is_seeded_and_follows_the_rules(llm: LLM) -> None:
    prompt = {"prompt_token_ids": PROMPT, "audio_features": _features(6)}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=2)
    first = [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    assert first == again and first[0] != first[1]
    rules = llm.engine.core.worker.runner.sampling.stages[0].rules  # the worker put Whisper's rules first
    for tokens in first:
        assert not set(tokens) & set(rules.suppress_tokens)
        assert tokens[0] not in rules.begin_suppress_tokens


def test_audio_features_cross_the_process_boundary_as_bytes() -> None:
    import time

    features = _features(7)
    data, shape = pack_encoder_input(features)
    message = EngineCoreRequest("r", PROMPT, SamplingParams(max_tokens=4), [50256], 4, 0.0, None, None, data, shape)
    start = time.perf_counter()
    for _ in range(20):
        back = decode(RequestType.ADD, encode(message))
    per_round_trip = (time.perf_counter() - start) / 20
    restored = unpack_encoder_input(back.encoder_input, back.encoder_input_shape)
    assert restored.dtype == np.float32 and np.array_equal(restored, features)
    assert per_round_trip < 0.05  # 960 kB: a memcpy or two (well under a millisecond alone on these cores)


@pytest.mark.slow
def test_multiprocess_engine_transcribes_like_the_in_process_one(llm: LLM, tiny_whisper_dir: str) -> None:
    """AsyncLLM over MultiprocEngine: the audio crosses ZMQ to the engine process; same greedy tokens."""
    import asyncio

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.mp_engine import MultiprocEngine
    from pagedllm.engine_args import EngineArgs

    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = [{"prompt_token_ids": PROMPT, "audio_features": _features(10 + i)} for i in range(3)]
    expected = _run(llm, prompts, params)
    config = EngineArgs(model=tiny_whisper_dir, dtype="float32", kv_cache_memory="64MiB").create_engine_config()
    async_llm = AsyncLLM(MultiprocEngine(config))

    async def one(i: int) -> list[int]:
        ids: list[int] = []
        async for out in async_llm.generate(prompts[i], params, f"r{i}"):
            ids += out.outputs[0].token_ids
        return ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(*[one(i) for i in range(3)])

    try:
        assert asyncio.run(main()) == expected
    finally:
        async_llm.shutdown(2.0)
