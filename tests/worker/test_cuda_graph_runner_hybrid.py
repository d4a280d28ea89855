"""A hybrid model (Gemma 3: sliding-window and full-attention KV cache groups) runs decode steps through the
graph runner too: one block table and slot mapping buffer per group. Checked on the CPU without capture, as
``test_cuda_graph_runner.py`` does for one group: the padded step equals the plain step."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata
from pagedllm.attention.spec import kv_cache_groups
from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.attention import attention_layers, attention_step, bind_kv_caches, step_readers
from pagedllm.model_executor.loader import load_model
from pagedllm.worker.cuda_graphs import DecodeGraphRunner

from helpers.arch_configs import save_tiny
from helpers.model_helpers import make_model_kv_caches

BLOCK = 4


def group_step(model, token_ids: list[list[int]], seq_lens: list[int], tables: list[list[list[int]]]
               ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata (group 0's, carrying every group's), input ids and positions of one step; ``tables[g][i]``
    is request i's block table in KV cache group g."""
    query_lens = [len(t) for t in token_ids]
    metas = [build_attention_metadata(query_lens, seq_lens, t, BLOCK) for t in tables]
    metas[0].group_metadata = metas
    ids = torch.tensor([t for row in token_ids for t in row])
    positions = torch.tensor([p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)])
    return metas[0], ids, positions


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    path, _ = save_tiny("Gemma3ForCausalLM", tmp_path_factory.mktemp("gemma3_graphs"), seed=5)
    model = load_model(ModelConfig(model=path, dtype="float32"), "cpu")
    groups, window = kv_cache_groups([m.spec for m in attention_layers(model)])
    assert window is not None and set(groups) == {0, 1}
    return model, groups


def test_padded_hybrid_decode_equals_plain_step(gemma3) -> None:
    model, groups = gemma3
    bind_kv_caches(model, make_model_kv_caches(model, 16, BLOCK), groups)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]  # within the window
    # Different physical blocks per group: a runner that read group 0's table for the sliding layers would
    # find their blocks empty.
    tables = [[[1, 2], [3], [4, 5, 6]], [[9, 10], [11], [12, 13, 14]]]
    lens = [len(p) for p in prompts]
    meta, ids, pos = group_step(model, prompts, lens, tables)
    with torch.inference_mode(), attention_step(meta, step_readers(model)):
        model(ids, pos)  # fill both groups' caches
    seq_lens = [n + 1 for n in lens]
    meta, ids, pos = group_step(model, [[21], [22], [23]], seq_lens, tables)
    with torch.inference_mode(), attention_step(meta, step_readers(model)):
        expected = model(ids, pos).clone()  # writes the K/V the runner writes again, to the same slots

    runner = DecodeGraphRunner(model, torch.device("cpu"), [1, 2, 4], max_blocks_per_seq=5, block_size=BLOCK,
                               hidden_size=model.config.hidden_size, dtype=torch.float32, num_kv_groups=2)
    assert runner.can_run(meta)
    for tables_buffer in runner.group_block_tables:
        tables_buffer.fill_(3)  # stale rows from a bigger earlier step would show
    with torch.inference_mode():
        got = runner.run(ids, pos, meta)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert runner.group_block_tables[1][:3, :3].tolist() == [[9, 10, 0], [11, 0, 0], [12, 13, 14]]
    assert runner.group_block_tables[1][3].abs().sum().item() == 0  # the dummy row reads the null block
    assert runner.group_slot_mappings[1][:3].tolist() == [10 * BLOCK + 1, 11 * BLOCK + 2, 14 * BLOCK + 1]


def test_a_runner_runs_only_steps_with_its_number_of_groups(gemma3) -> None:
    model, _ = gemma3
    one = DecodeGraphRunner(model, torch.device("cpu"), [1, 2], max_blocks_per_seq=4, block_size=BLOCK,
                            hidden_size=model.config.hidden_size, dtype=torch.float32)
    two = DecodeGraphRunner(model, torch.device("cpu"), [1, 2], max_blocks_per_seq=4, block_size=BLOCK,
                            hidden_size=model.config.hidden_size, dtype=torch.float32, num_kv_groups=2)
    hybrid, _, _ = group_step(model, [[1]], [3], [[[1]], [[2]]])
    plain = build_attention_metadata([1], [3], [[1]], BLOCK)
    assert two.can_run(hybrid) and not one.can_run(hybrid)
    assert one.can_run(plain) and not two.can_run(plain)
    wide, _, _ = group_step(model, [[1]], [3], [[[1]], [[2, 3, 4, 5, 6]]])  # the sliding table too wide
    assert not two.can_run(wide)
