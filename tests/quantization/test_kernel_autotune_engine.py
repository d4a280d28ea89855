"""The default GGUF with kernels chosen per row count (both 4-bit layouts in one model): greedy outputs equal
the packing's own kernel, alone and batched."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.quantization import kernel_choice
from pagedllm.platforms import platform_for

from helpers.autotune import dense_for_many_rows, words_from_three_rows

PROMPTS = ["The capital of France is", "Write a short poem about the sea:", "1, 2, 3, 4,",
           "def fibonacci(n):", "Water boils at", "My favourite book is"]


def _layers(llm: LLM) -> list:
    model = llm.engine.core.worker.runner.model
    return [m for m in model.modules() if isinstance(getattr(m, "qpanels", None), kernel_choice.QPanels)
            and m.qpanels.is_q4]


@pytest.mark.slow
def test_mixed_layouts_by_row_count_keep_greedy_outputs(default_model_path, tmp_path, monkeypatch) -> None:
    kernels = platform_for(torch.device("cpu")).cpu_kernels(torch.float32)
    if kernels is None:
        pytest.skip("the C++ CPU kernels did not build here")
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(default_model_path, kv_cache_memory="64MiB", cpu_kernel_autotune="off")
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    keys = {kernel_choice.shape_key(m.qpanels) for m in _layers(plain)}
    assert {m.qpanels.layout for m in _layers(plain)} == {"dot8"}
    del plain

    isa = kernel_choice.ISA_NAMES[kernel_choice._isas(kernels)[0]]
    mixed = [f"dot8/{isa}", f"dot8/{isa}", f"pairs/{isa}", f"pairs/{isa}", f"pairs/{isa}"]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": {key: {"choices": mixed} for key in keys}}))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE", str(table))
    llm = LLM(default_model_path, kv_cache_memory="64MiB", cpu_kernel_autotune="on")
    layers = _layers(llm)
    # Every 4-bit layer dispatches by row count, its dot8 copy the weight of few-row steps.
    assert layers and all(m.packed.cpu_matmul().__qualname__ == "by_rows.<locals>.run" for m in layers)
    assert {m.qpanels.layout for m in layers} == {"dot8"}
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]  # dot8 rows
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 4, params, use_tqdm=False)]  # pairs rows
    assert alone == expected
    assert batched[:len(PROMPTS)] == expected


def _alone_and_batched_on_a_forced_table(model_path, tmp_path, monkeypatch, make_table, copies: int
                                         ) -> tuple[dict, list, list]:
    """(the forced table ``make_table(model)`` builds, each prompt's greedy tokens alone on the packings' own
    kernels, the tokens of ``PROMPTS * copies`` batched on the forced table)."""
    kernels = platform_for(torch.device("cpu")).cpu_kernels(torch.float32)
    if kernels is None:
        pytest.skip("the C++ CPU kernels did not build here")
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = LLM(model_path, kv_cache_memory="64MiB", cpu_kernel_autotune="off")
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    forced = make_table(plain.engine.core.worker.runner.model)
    del plain
    table = tmp_path / "table.json"
    table.write_text(json.dumps(forced))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE", str(table))
    llm = LLM(model_path, kv_cache_memory="64MiB", cpu_kernel_autotune="on")
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * copies, params, use_tqdm=False)]
    return forced, expected, batched


@pytest.mark.slow
def test_dense_copies_for_many_rows_keep_greedy_outputs(default_model_path, tmp_path, monkeypatch) -> None:
    """Every quantized layer (the LM head included) on its dense copy from 33 rows on: a batch of 36 sequences
    decodes the same greedy tokens as each prompt alone on the quantized kernels."""
    forced, expected, batched = _alone_and_batched_on_a_forced_table(default_model_path, tmp_path, monkeypatch,
                                                                     dense_for_many_rows, 6)  # 36 rows
    assert any(key.endswith(":head") for key in forced["entries"])
    for i, want in enumerate(expected):
        assert batched[i] == want, PROMPTS[i]


@pytest.mark.slow
def test_words_tiles_for_many_rows_keep_greedy_outputs(default_model_path, tmp_path, monkeypatch) -> None:
    """Every 4-bit layer and the Q8_0 LM head on their words tiles from 3 rows on (int16 pair products, rounded
    once per group where the byte tiles round twice): a batch of 24 decodes the same greedy tokens as each prompt
    alone on the byte tiles."""
    forced, expected, batched = _alone_and_batched_on_a_forced_table(default_model_path, tmp_path, monkeypatch,
                                                                     words_from_three_rows, 4)
    assert any(key.endswith(":head") for key in forced["entries"]) and len(forced["entries"]) >= 4
    for i, want in enumerate(expected):
        assert batched[i] == want, PROMPTS[i]
