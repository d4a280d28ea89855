"""Adapters with the rest of the engine: quantized base layers keep their packed weight under the LoRA term,
speculative decoding with an adapter stays lossless, and the engine in its own process gets the adapter through
its messages."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.layer_weight import LoRAStepContext, LoRAWeight
from pagedllm.lora.peft_checkpoint import LoRAModule
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.segments import plan_step
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization.weight_only import Int8Config

from helpers.arch_configs import save_word_tokenizer
from helpers.lora_helpers import make_adapter, peft_greedy
from helpers.model_helpers import make_tiny_llama

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, *range(30, 60)]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_features")
    base = make_tiny_llama(root / "base")
    save_word_tokenizer(base)
    adapter = make_adapter(base, root / "a", r=8, seed=3)
    expected = [peft_greedy(base, adapter, p, MAX_TOKENS) for p in PROMPTS]
    assert expected != [peft_greedy(base, None, p, MAX_TOKENS) for p in PROMPTS]
    return base, adapter, expected


def test_an_int8_layer_keeps_its_kernel_and_adds_the_term() -> None:
    torch.manual_seed(0)
    layer = Linear(32, 24, bias=True, quant_config=Int8Config(), shard_sizes=(16, 8), prefix="m.gate_up_proj")
    layer.weight.weight_loader(layer.weight, torch.randn(24, 32))
    layer.process_weights_after_loading()
    base = layer.packed
    context = LoRAStepContext()
    layer.bind_weight(LoRAWeight(base, context, max_loras=1, max_rank=4, shard_sizes=layer.shard_sizes))
    up = LoRAModule(torch.randn(4, 32), torch.randn(8, 4))
    layer.packed.set_slot(0, {1: up})
    x = torch.randn(5, 32)
    context.plan = plan_step([0, -1], [3, 2], 8, torch.device("cpu"))
    expected = base.matmul(x, layer.bias)
    expected[:3, 16:] += x[:3] @ up.a.t() @ up.b.t()
    torch.testing.assert_close(layer(x), expected)
    assert "LoRA" in layer.packed.describe() and layer.packed.base is base


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "layer_skip"])
def test_speculation_with_an_adapter_is_lossless(setup, method: str) -> None:
    """Every proposer (a separate draft model and the target's first layer propose as they do for the base model)
    and the target verifying with the adapter: the adapter's greedy tokens, as transformers + peft give them."""
    base, adapter, expected = setup
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "draft_model":
        config["model"] = base  # the base model drafts, without the adapter
    elif method == "layer_skip":
        config["num_draft_layers"] = 1
    llm = LLM(base, enable_lora=True, dtype="float32", kv_cache_dtype="float32", kv_cache_memory="8MiB",
              max_model_len=128, speculative_config=config)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0  # drafts were proposed and verified


@pytest.mark.slow  # an engine process start
def test_engine_in_its_own_process_receives_the_adapter(setup) -> None:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine_args import EngineArgs

    base, adapter, expected = setup
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=base, enable_lora=True, dtype="float32", kv_cache_dtype="float32", kv_cache_memory="8MiB",
        max_model_len=128))

    async def run(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, GREEDY, f"r{i}",
                                         lora_request=LoRARequest("a", 1, adapter)):
            tokens.extend(out.outputs[0].token_ids)  # streamed deltas
        return tokens

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(run(0), run(1)))

    try:
        assert type(engine.engine).__name__ == "MultiprocEngine"
        assert asyncio.run(both()) == expected
    finally:
        engine.shutdown(0.0)
