"""A Llama decoder as an embedder (``runner="pooling"``): last-token (and mean) pooling of transformers'
final hidden states, also when chunked prefill splits the prompt; KV blocks are all free afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.pooling_params import PoolingParams

from helpers.model_helpers import make_tiny_llama

PROMPTS = [[5, 17, 42, 3, 99, 100, 7], list(range(10, 80)), [200], [i * 7 % 250 + 3 for i in range(33)]]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama with the default model's tokenizer (the engine needs a tokenizer)."""
    from pagedllm.config import ModelConfig
    from pagedllm.model_executor.loader import load_tokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_pool"), vocab_size=49152)
    load_tokenizer(ModelConfig()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hidden_states(llama_dir) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


@pytest.mark.parametrize("budget", [2048, 16])  # 16: prompts of 33 and 70 tokens arrive in chunks
def test_last_token_pooling_matches_transformers(llama_dir, hidden_states, budget):
    llm = LLM(llama_dir, runner="pooling", dtype="float32", max_num_batched_tokens=budget, kv_cache_memory="8MiB")
    assert llm.engine.config.model.pooler_config.pooling_type == "LAST"
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for out, hidden in zip(outs, hidden_states):
        expected = F.normalize(hidden[-1], dim=-1)
        assert torch.allclose(torch.tensor(out.outputs.embedding), expected, atol=1e-4)
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_usable_blocks and not kv.req_to_blocks


def test_mean_pooling_across_chunks(llama_dir, hidden_states):
    llm = LLM(llama_dir, runner="pooling", dtype="float32", max_num_batched_tokens=16,
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for out, hidden in zip(outs, hidden_states):
        assert torch.allclose(torch.tensor(out.outputs.embedding), hidden.mean(0), atol=1e-4)


def test_matryoshka_dimensions_when_enabled(llama_dir, hidden_states):
    llm = LLM(llama_dir, runner="pooling", dtype="float32", pooler_config={"enable_matryoshka": True})
    out = llm.embed([PROMPTS[0]], PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert torch.allclose(torch.tensor(out.outputs.embedding), F.normalize(hidden_states[0][-1, :16], dim=-1),
                          atol=1e-4)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=65), use_tqdm=False)


def test_embed_on_generative_llm_is_a_value_error(llama_dir):
    llm = LLM(llama_dir, dtype="float32")
    assert llm.engine.config.model.runner == "generate"
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="generate runner"):
        llm.engine.add_request("x", [1, 2, 3], PoolingParams())
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
