"""The grouped LoRA term against a per-row loop: base rows untouched, every slot's rows their own term, padded
tiles dropped; and a LoRAWeight's fused layout (an adapter on q alone adds nothing to k / v)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora.layer_weight import LoRAStepContext, LoRAWeight
from pagedllm.lora.peft_checkpoint import LoRAModule
from pagedllm.lora.segments import add_lora_term, choose_tile_rows, plan_step
from pagedllm.model_executor.layers.quantization.float_weights import PlainWeight


def _reference(x, a_slots, b_slots, row_slots):
    y = torch.zeros(x.shape[0], b_slots.shape[2])
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            y[row] = x[row] @ a_slots[slot] @ b_slots[slot]
    return y


@pytest.mark.parametrize(("request_slots", "query_lens"), [
    ([0, 1, -1, 2], [1, 1, 1, 1]),  # decodes, one base row
    ([1, -1, 1, 0], [37, 5, 1, 1]),  # a long prefill beside decodes: padded tiles
    ([2, 2, 2], [3, 8, 1]),  # one slot, no padding
    ([2, 0, -1, 2], [2, 1, 1, 1]),  # direct layout over slots 0..2, slot 1 an all-padding tile
])
def test_grouped_term_equals_a_loop(request_slots, query_lens) -> None:
    torch.manual_seed(0)
    k, n, r, slots = 24, 40, 6, 3
    a_slots, b_slots = torch.randn(slots, k, r), torch.randn(slots, r, n)
    rows = sum(query_lens)
    x = torch.randn(rows, k)
    row_slots = [s for s, q in zip(request_slots, query_lens) for _ in range(q)]
    plan = plan_step(request_slots, query_lens, r, torch.device("cpu"))
    y = add_lora_term(torch.zeros(rows, n), x, a_slots, b_slots, plan)
    torch.testing.assert_close(y, _reference(x, a_slots, b_slots, row_slots), rtol=1e-5, atol=1e-5)


def test_no_adapter_row_plans_nothing_and_a_wrong_batch_raises() -> None:
    assert plan_step([-1, -1], [3, 1], 8, torch.device("cpu")) is None
    plan = plan_step([0], [2], 8, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="planned for 2 rows"):
        add_lora_term(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(1, 4, 8), torch.zeros(1, 8, 4), plan)


def test_tile_length_weighs_padding_against_tiles() -> None:
    assert choose_tile_rows([1, 1, 1], 48)[0] == 1
    assert choose_tile_rows([8, 8, 8, 8], 16)[0] == 8
    assert choose_tile_rows([512, 1, 1], 48)[0] == 128  # 6 tiles, 256 padded rows: less than 8 x 64 or 1 x 512


def test_decodes_take_the_direct_layout_and_a_long_prefill_the_tiled_one() -> None:
    cpu = torch.device("cpu")
    decode = plan_step([0, 1, 2, 3] * 4, [1] * 16, 48, cpu)
    assert decode.slot_range == (0, 4) and decode.tile_rows == 4 and decode.tile_slots is None
    mixed = plan_step([0, 1, 2], [300, 1, 1], 48, cpu)
    assert mixed.slot_range is None and mixed.tile_slots.tolist() == [0] * 5 + [1, 2]  # 5 tiles of 64 rows


def test_fused_layer_bands_keep_shards_apart() -> None:
    torch.manual_seed(0)
    k, shards = 8, (6, 4, 4)  # q / k / v rows
    base = PlainWeight(torch.randn(sum(shards), k))
    context = LoRAStepContext()
    weight = LoRAWeight(base, context, max_loras=2, max_rank=4, shard_sizes=shards)
    q = LoRAModule(torch.randn(3, k), torch.randn(6, 3))
    v = LoRAModule(torch.randn(2, k), torch.randn(4, 2))
    weight.set_slot(1, {0: q, 2: v})
    # each band's output columns (what the kernels read B's rows for): q's and v's shard, none for k
    assert weight.band_cols[1].tolist() == [[0, 6], [0, 0], [10, 14]] and not weight.band_cols[0].any()
    x = torch.randn(3, k)
    plain = base.matmul(x)
    torch.testing.assert_close(weight.fast_matmul()(x, None, None), plain)  # no plan: the base alone
    context.plan = plan_step([1, -1], [2, 1], 12, torch.device("cpu"))
    y = weight.fast_matmul()(x, None, None)
    expected = plain.clone()
    expected[:2, :6] += x[:2] @ q.a.t() @ q.b.t()
    expected[:2, 10:] += x[:2] @ v.a.t() @ v.b.t()
    torch.testing.assert_close(y, expected)
    weight.clear_slot(1)
    torch.testing.assert_close(weight.matmul(x), plain)
    assert not weight.band_cols.any()
    weight.set_slot(0, {None: LoRAModule(torch.randn(2, k), torch.randn(14, 2))})  # one module over q/k/v whole
    assert weight.band_cols[0].tolist() == [[0, 14], [0, 0], [0, 0]]
