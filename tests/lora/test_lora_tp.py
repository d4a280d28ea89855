"""Tensor parallelism with adapters: A and B split like the layer they sit beside (a column-parallel layer's rows
of B, a row-parallel layer's columns of A, summed by its all-reduce), so TP=2 greedy equals TP=1, a batch mixing
the base model and two adapters included; and Phi-3, whose adapters target the fused matrices whole."""

from __future__ import annotations

import pytest

from pagedllm.lora.request import LoRARequest

from helpers.lora_helpers import make_adapter
from helpers.tp_helpers import PROMPTS, tiny

pytestmark = pytest.mark.slow  # two engines with two ranks each

MAX_TOKENS = 10


def _greedy(model: str, tp: int, loras: list) -> list[list[int]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory="16MiB", max_model_len=128, dtype="float32",
              kv_cache_dtype="float32", enable_lora=True, max_loras=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False,
                            lora_request=loras)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize(("arch", "targets"), [
    ("LlamaForCausalLM", None),
    ("Phi3ForCausalLM", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
])
def test_tp2_with_adapters_equals_tp1(arch: str, targets, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    base = tiny(arch, tmp_path)
    a = make_adapter(base, tmp_path / "a", r=4, targets=targets, seed=1, model_cls=AutoModelForCausalLM)
    b = make_adapter(base, tmp_path / "b", r=8, targets=targets, seed=2, model_cls=AutoModelForCausalLM)
    loras = [LoRARequest("a", 1, a), None, LoRARequest("b", 2, b)]
    want = _greedy(base, 1, loras)
    assert want != _greedy(base, 1, [None] * len(PROMPTS))
    assert _greedy(base, 2, loras) == want
