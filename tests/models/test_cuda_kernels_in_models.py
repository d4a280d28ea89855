"""The CUDA path's kernels inside whole models, without a GPU: the Triton attention backend (rotary writing
K/V into the cache, sliding windows, mixed steps) and the Triton RMSNorm / SiLU-and-mul / rotary run by
Triton's interpreter on CPU tensors, in every architecture, against transformers. The kernel tests check each
kernel alone; this checks how the models wire them (q/k norms before rotary, hybrid layers, tied heads), and
through the whole engine (scheduler, chunked prefill, sampler) as it runs on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.kernels import triton_ops
from pagedllm.model_executor.layers.attention import bind_kv_caches
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.arch_configs import hf_greedy, save_tiny
from helpers.model_helpers import (
    cpu_tensors_get_cuda_elementwise_ops,
    cpu_tensors_get_triton_attention,
    make_model_kv_caches,
    paged_step,
)

# CPU tensors reach Triton kernels only through the interpreter (tests/conftest.py turns it on without a GPU).
# Slow: whole models through the interpreted kernels, about a minute on 2 cores.
pytestmark = [pytest.mark.skipif(not triton_ops.triton_available() or not triton_ops.interpreted(),
                                 reason="triton is a test dependency; the interpreter runs these on the CPU"),
              pytest.mark.slow]
ARCHS = ["LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM", "GPT2LMHeadModel"]


@pytest.fixture
def cuda_kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Route CPU tensors to the kernels CUDA tensors get; count the fused rotary + KV-write launches."""
    calls = {"rotary_and_write_kv_": 0}
    fused = triton_ops.rotary_and_write_kv_

    def counted(*args, **kwargs):
        calls["rotary_and_write_kv_"] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "rotary_and_write_kv_", counted)
    cpu_tensors_get_cuda_elementwise_ops(monkeypatch)
    cpu_tensors_get_triton_attention(monkeypatch)
    return calls


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decodes_match_transformers(arch: str, cuda_kernels_on_cpu, tmp_path) -> None:
    """Request A: a prefill in two chunks, then decodes; B joins mid-way and shares steps (past the window of
    the sliding models)."""
    path, hf = save_tiny(arch, tmp_path)
    model = load_model(resolve_model_config(ModelConfig(model=path, dtype="float32")), torch.device("cpu"))
    bs = 8
    bind_kv_caches(model, make_model_kv_caches(model, num_blocks=20, block_size=bs))
    a, b = _ids(30, seed=2), _ids(21, seed=3)
    table_a, table_b = [7, 2, 9, 4], [1, 11, 13]
    got_a = [paged_step(model, [a[0:12]], [12], [table_a], bs), paged_step(model, [a[12:27]], [27], [table_a], bs)]
    out = paged_step(model, [a[27:28], b[0:19]], [28, 19], [table_a, table_b], bs)
    got_a.append(out[:1])
    got_b = [out[1:]]
    for pos in (28, 29):
        out = paged_step(model, [a[pos:pos + 1], b[pos - 9:pos - 8]], [pos + 1, pos - 8], [table_a, table_b], bs)
        got_a.append(out[:1])
        got_b.append(out[1:])
    with torch.no_grad():
        want_a, want_b = (hf(torch.tensor([ids])).logits[0].float() for ids in (a, b))
    torch.testing.assert_close(torch.cat(got_a), want_a, atol=2e-4, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), want_b, atol=2e-4, rtol=0)
    rotary_layers = 0 if arch == "GPT2LMHeadModel" else len(make_model_kv_caches(model, 1, bs))
    assert cuda_kernels_on_cpu["rotary_and_write_kv_"] == 5 * rotary_layers  # every rotary layer, every step


def test_engine_greedy_matches_transformers(cuda_kernels_on_cpu, tmp_path) -> None:
    """The whole engine on the CUDA kernels: chunked prefills sharing steps with decodes, greedy sampling."""
    from pagedllm import LLM, SamplingParams

    path, hf = save_tiny("Qwen3ForCausalLM", tmp_path)
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=32)
    prompts = [_ids(n, seed=10 + n) for n in (5, 23, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]
    assert cuda_kernels_on_cpu["rotary_and_write_kv_"] > 0
