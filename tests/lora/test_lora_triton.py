"""The Triton multi-LoRA kernel (CUDA path) against the torch reference, through Triton's interpreter on the CPU;
on a GPU machine run with PAGEDLLM_TEST_DEVICE=cuda TRITON_INTERPRET=0."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.kernels import triton_ops  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_ops.triton_available(), reason="triton is a test dependency")

from helpers.lora_helpers import lora_reference as _reference  # noqa: E402
from helpers.lora_helpers import random_row_slots as _row_slots  # noqa: E402
from helpers.lora_helpers import random_slot_buffers as _slots  # noqa: E402


@pytest.mark.parametrize("rows", [1, 17, 64])
@pytest.mark.parametrize("max_rank", [8, 16, 24])  # 24: a rank that is not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_the_torch_reference(rows: int, max_rank: int, dtype: torch.dtype) -> None:
    from pagedllm.kernels.triton_lora import lora_sgmv_

    k, n, bands, num_slots = 96, 200, 2, 4
    ranks = [max_rank, max_rank // 2, 0, max_rank]  # slot 1: no module on band 1; slot 3: one over both bands
    a, b, slot_ranks, band_cols = _slots(num_slots, k, n, bands, max_rank, ranks, seed=rows + max_rank,
                                         missing=((1, 1),), whole=(3,))
    a, b = a.to(dtype), b.to(dtype)  # bf16 rows beside bf16 slot buffers, as a bf16 model keeps them
    row_slots = [0] if rows == 1 else _row_slots(rows, num_slots, seed=rows)
    x = torch.randn(rows, k).to(dtype)
    y0 = torch.randn(rows, n).to(dtype)
    want = _reference(y0.clone(), x, a.float(), b.float(), row_slots)
    got = y0.to(DEVICE, copy=True)
    lora_sgmv_(got, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), slot_ranks.to(DEVICE), max_rank,
               torch.tensor(row_slots, dtype=torch.int32, device=DEVICE), band_cols.to(DEVICE))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    base = torch.tensor([s < 0 or ranks[s] == 0 for s in row_slots])
    assert torch.equal(got.cpu()[base], y0[base])


def test_the_triton_kernel_in_the_engine_equals_peft(tmp_path) -> None:
    """The kernel as CUDA runs it (``choose_lora_kernel``: adapter steps eager, row slots on the model's device),
    through the interpreter in a float32 engine on the CPU: a batch mixing the base model with two adapters equals
    transformers + peft request by request."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels.triton_lora import lora_sgmv_
    from pagedllm.lora.model_manager import choose_lora_kernel
    from pagedllm.lora.request import LoRARequest

    from helpers.arch_configs import save_word_tokenizer
    from helpers.lora_helpers import make_adapter, peft_greedy
    from helpers.model_helpers import make_tiny_llama

    assert choose_lora_kernel(None, torch.device("cuda")) == (lora_sgmv_, False)
    assert choose_lora_kernel(None, torch.device("cpu")) == (None, False)  # no C++ kernels: the torch path
    base = make_tiny_llama(tmp_path / "base")
    save_word_tokenizer(base)
    adapters = [make_adapter(base, tmp_path / f"a{i}", r=r, seed=40 + i) for i, r in enumerate((4, 8))]
    prompts = [[1, *range(10, 30)], [1, 7, 99, 3, 42, 8], [1, *range(200, 170, -3)]]
    llm = LLM(base, enable_lora=True, dtype="float32", kv_cache_dtype="float32", max_model_len=128,
              kv_cache_memory="8MiB", max_loras=2, enforce_eager=True)
    lora = llm.engine.core.worker.runner.lora
    calls = []

    def counted(*args) -> None:
        calls.append(args[6].numel())
        lora_sgmv_(*args)

    lora.context.kernel, lora._kernel_in_graphs = counted, False  # as choose_lora_kernel sets it on CUDA
    requests = [None, LoRARequest("a0", 1, adapters[0]), LoRARequest("a1", 2, adapters[1])]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        peft_greedy(base, None if r is None else r.lora_path, p, 6) for p, r in zip(prompts, requests)]
    assert calls  # the terms came from the Triton kernel
    base_only = [peft_greedy(base, None, p, 6) for p in prompts[1:]]
    assert all(list(o.outputs[0].token_ids) != b for o, b in zip(outs[1:], base_only))  # each adapter mattered
