"""``--attention-backend`` forces how an engine attends; every choice gives the outputs of the default one
(transformers' greedy continuation), and a choice the platform cannot run fails at start-up, naming the flag."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.attention.backends.cpu_paged import CpuPagedAttentionBackend
from pagedllm.attention.backends.registry import get_attention_backend
from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_args import EngineArgs
from pagedllm.model_executor.layers.attention import attention_layers
from pagedllm.platforms import platform_for

from helpers.arch_configs import hf_greedy, save_tiny


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("backend_flag"), seed=3)


def make_engine(path: str, backend: str) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="4MiB", block_size=8,
                                                 max_num_batched_tokens=16, attention_backend=backend))


def greedy(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


@pytest.mark.parametrize("backend,cls", [("auto", CpuPagedAttentionBackend), ("cpu", CpuPagedAttentionBackend),
                                         ("torch", TorchPagedAttentionBackend)])
def test_each_backend_gives_transformers_greedy_output(llama, backend: str, cls: type, caplog) -> None:
    path, hf = llama
    prompts = {f"r{i}": torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, n in enumerate([5, 21, 12])}  # 21 > the 16-token budget: a chunked prefill with context
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        engine = make_engine(path, backend)
    layers = attention_layers(engine.core.worker.runner.model)
    assert layers and all(type(layer.backend) is cls for layer in layers)
    assert f"attention backend: {cls.name}" in caplog.text
    got = greedy(engine, prompts, max_tokens=8)
    assert got == {rid: hf_greedy(hf, p, 8) for rid, p in prompts.items()}


def test_a_backend_the_platform_cannot_run_fails_naming_the_flag(llama) -> None:
    path, _ = llama
    with pytest.raises(ValueError, match="attention_backend: 'triton' does not run on the cpu platform"):
        make_engine(path, "triton")
    with pytest.raises(ValueError, match="attention_backend: must be one of auto, cpu, torch, triton"):
        make_engine(path, "flash")


def test_the_registry_makes_each_backend_once() -> None:
    cpu = platform_for("cpu")
    assert get_attention_backend(cpu, "torch") is get_attention_backend(cpu, "torch")
    assert type(get_attention_backend(cpu, "torch")) is TorchPagedAttentionBackend
    assert type(get_attention_backend(cpu)) is CpuPagedAttentionBackend
    with pytest.raises(ValueError, match="'cpu' does not run on the cuda platform"):
        get_attention_backend(platform_for("cuda"), "cpu")


def test_a_draft_model_attends_through_the_engines_backend(llama) -> None:
    path, _ = llama
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=path, dtype="float32", kv_cache_memory="4MiB", block_size=8, attention_backend="torch",
        speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2}))
    runner = engine.core.worker.runner
    layers = attention_layers(runner.model) + attention_layers(runner.draft_model)
    assert len(layers) == 2 * len(attention_layers(runner.model))
    assert all(type(layer.backend) is TorchPagedAttentionBackend for layer in layers)
