"""Random PEFT LoRA adapters on the tiny Llama (``model_helpers.make_tiny_llama``) and transformers + peft's greedy
output as the reference."""

from __future__ import annotations

import os
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, out_path: str | os.PathLike, r: int = 8, alpha: float = 16.0,
                 targets: list[str] | None = None, seed: int = 0, scale: float = 0.3, model_cls: Any = None,
                 **lora_kwargs: Any) -> str:
    """Save a random LoRA adapter for the model at ``base_path`` (A and B drawn N(0, scale): big enough to change
    the greedy output) as a PEFT folder; returns its path. ``model_cls``: the transformers class (Llama's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = (model_cls or LlamaForCausalLM).from_pretrained(base_path, torch_dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                        init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(str(out_path))
    return str(out_path)


def peft_greedy(base_path: str, adapter_path: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers (+ peft's adapter when given), full forward passes, float32."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base_path, torch_dtype=torch.float32)
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path)
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# ---- slot buffers for the LoRA kernels' tests (tests/lora/test_lora_kernel.py, test_lora_triton.py) ----

def random_slot_buffers(num_slots: int, k: int, n: int, bands: int, max_rank: int, ranks: list[int], seed: int,
                        missing: tuple[tuple[int, int], ...] = (), whole: tuple[int, ...] = ()):
    """A [S, K, bands * max_rank], B [S, bands * max_rank, N], the int32 ranks and band_cols [S, bands, 2], as
    LoRAWeight fills them: zero past each slot's rank; band b writes y's columns [n * b // bands, n * (b + 1) //
    bands) (a fused layer's shard; cuts that fall inside the kernels' tiles), or all of them for the slots in
    ``whole`` (one module over the fused layer, in band 0); the (slot, band) pairs in ``missing`` hold no module."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(num_slots, k, bands * max_rank)
    b = torch.zeros(num_slots, bands * max_rank, n)
    band_cols = torch.zeros(num_slots, bands, 2, dtype=torch.int32)
    for s, rank in enumerate(ranks):
        for band in range(1 if s in whole else bands):
            if rank == 0 or (s, band) in missing:
                continue
            cols = (0, n) if s in whole else (n * band // bands, n * (band + 1) // bands)
            lo = band * max_rank
            a[s, :, lo:lo + rank] = torch.randn(k, rank, generator=g) / k ** 0.5
            b[s, lo:lo + rank, cols[0]:cols[1]] = torch.randn(rank, cols[1] - cols[0], generator=g)
            band_cols[s, band] = torch.tensor(cols, dtype=torch.int32)
    return a, b, torch.tensor(ranks, dtype=torch.int32), band_cols


def random_row_slots(rows: int, num_slots: int, seed: int) -> list[int]:
    """Each row's slot (-1 = base model) in runs of random length, so segments mix and repeat."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < rows:
        slot = int(torch.randint(-1, num_slots, (1,), generator=g))
        out.extend([slot] * int(torch.randint(1, 6, (1,), generator=g)))
    return out[:rows]


def lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   row_slots: list[int]) -> torch.Tensor:
    """y += the LoRA term through the torch reference (``segments.add_lora_term``), one row per request."""
    from pagedllm.lora.segments import add_lora_term, plan_step

    plan = plan_step(row_slots, [1] * len(row_slots), a.shape[2], torch.device("cpu"))
    return y if plan is None else add_lora_term(y, x, a, b, plan)
