"""--kv-cache-dtype: a bfloat16 KV cache under a float32 model (the default GGUF on the CPU). Half the bytes per
block; K/V rounded once as they are stored, and every path (kernel, SDPA, chunks, prefix hits) reads them so."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine_args import EngineArgs
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.interface import Platform

from helpers.model_helpers import make_tiny_llama
from helpers.prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _ids(llm: LLM, prompts: list[str] | str) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_platforms_offer_the_dtypes_their_attention_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = CpuPlatform()
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    assert cpu.kv_cache_dtypes(torch.float32) == (torch.float32, torch.bfloat16, *fp8)
    assert cpu.kv_cache_dtypes(torch.bfloat16) == (torch.bfloat16, torch.float32, *fp8)
    assert cpu.kv_cache_dtypes(torch.float16) == (torch.float16,)
    assert Platform().kv_cache_dtypes(torch.bfloat16) == (torch.bfloat16,)  # the interface: the model's own only
    from pagedllm.platforms.cuda import CudaPlatform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert CudaPlatform().kv_cache_dtypes(torch.bfloat16) == (torch.bfloat16, *fp8)  # Triton reads fp8 too
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert CudaPlatform().kv_cache_dtypes(torch.bfloat16) == (torch.bfloat16,)  # no native fp8 before sm_89


@pytest.mark.parametrize("value", ["fp9", "float16", "int8", "fp8_e3m4"])
def test_unsupported_kv_cache_dtype_names_the_field(tmp_path, value: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model=make_tiny_llama(tmp_path / "m"), kv_cache_dtype=value).create_engine_config()


def test_auto_resolves_to_the_model_dtype_and_aliases_to_names(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "m")
    assert EngineArgs(model=model, dtype="float32").create_engine_config().cache.kv_cache_dtype == "float32"
    cfg = EngineArgs(model=model, dtype="float32", kv_cache_dtype="bf16").create_engine_config()
    assert cfg.cache.kv_cache_dtype == "bfloat16"


def test_a_dtype_the_platform_cannot_keep_is_refused_at_start(tmp_path) -> None:
    from pagedllm.worker.worker import Worker

    config = EngineArgs(model=make_tiny_llama(tmp_path / "m"), dtype="float16", kv_cache_dtype="bfloat16",
                        kv_cache_memory="8MiB").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_dtype: bfloat16 is not available for a float16 model on cpu"):
        Worker(config)


# The default model's engines below: deselected by -m "not slow".

@pytest.fixture(scope="module")
def bf16() -> LLM:
    return LLM(kv_cache_dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=1024, dtype="float32")


@pytest.fixture(scope="module")
def solo(bf16: LLM) -> list[list[int]]:
    return [_ids(bf16, p)[0] for p in PROMPTS]


@pytest.mark.slow
def test_blocks_take_half_the_bytes(bf16: LLM, llm: LLM) -> None:
    ours, theirs = bf16.engine.core.worker, llm.engine.core.worker
    assert ours.runner.kv_caches[0].dtype == torch.bfloat16 and theirs.runner.kv_caches[0].dtype == torch.float32
    assert 2 * ours.runner.bytes_per_block() == theirs.runner.bytes_per_block()
    assert ours.config.cache.num_blocks >= 2 * theirs.config.cache.num_blocks - 2  # same 64 MiB budget


@pytest.mark.slow
def test_batched_equals_solo(bf16: LLM, solo: list[list[int]]) -> None:
    assert _ids(bf16, PROMPTS) == solo


@pytest.mark.slow
def test_batched_equals_solo_under_preemption_and_chunking(solo: list[list[int]]) -> None:
    # As tests/engine/test_batching.py, in half the memory: the same ~12 blocks of bf16 K/V.
    tight = LLM(kv_cache_dtype="bfloat16", kv_cache_memory="4.5MiB", max_num_batched_tokens=24,
                max_model_len=256, dtype="float32")
    outs = _ids(tight, PROMPTS)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert outs == solo
    assert tight.engine.core.scheduler.kv.usage == 0.0


@pytest.mark.slow
def test_prefix_hits_equal_misses(bf16: LLM) -> None:
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 6
    prompts = [shared + q for q in ("What is 2+2?", "Name a colour.")]
    off = LLM(kv_cache_dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="32MiB",
              max_model_len=1024, dtype="float32")
    want = _ids(off, prompts)
    bf16.generate(prompts[:1], GREEDY, use_tqdm=False)
    got = bf16.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want and got[0].num_cached_tokens > 0


@pytest.mark.slow
def test_logprobs_stay_close_to_the_float32_cache(bf16: LLM, llm: LLM) -> None:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompt = PROMPTS[4] * 8  # ~100 tokens of context
    ours = bf16.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]
    theirs = llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]
    diffs = []
    for a, b in zip(ours, theirs, strict=True):
        (tok, lp), = ((t, p.logprob) for t, p in a.items() if t in b)  # the prompt's own token
        diffs.append(abs(lp - b[tok].logprob))
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02


@pytest.mark.slow
def test_a_bf16_model_keeps_a_float32_cache_on_request() -> None:
    """The other way round: bf16 K/V widened exactly into float32 blocks (twice the bytes), attended by the float32
    kernel instead of bf16 dot products: the same model's logprobs within rounding of its bf16 cache's."""
    kw = dict(dtype="bfloat16", quantization="none", kv_cache_memory="32MiB", max_model_len=512)
    wide, narrow = LLM(kv_cache_dtype="float32", **kw), LLM(**kw)
    runner = wide.engine.core.worker.runner
    assert runner.kv_caches[0].dtype == torch.float32
    assert runner.bytes_per_block() == 2 * narrow.engine.core.worker.runner.bytes_per_block()
    params = SamplingParams(max_tokens=4, prompt_logprobs=0, temperature=0.0)
    prompt = PROMPTS[7] * 6
    a, b = (llm.generate(prompt, params, use_tqdm=False)[0] for llm in (wide, narrow))
    diffs = [abs(next(p.logprob for t, p in x.items() if t in y) - next(p.logprob for t, p in y.items() if t in x))
             for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)]
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.3
