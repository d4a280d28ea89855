"""The decode-graph runner's ladder, padding and persistent buffers, checked on the CPU without capture:
a padded decode step through the buffers must give the same hidden states as the plain step."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.attention import attention_step, bind_kv_caches, step_readers
from pagedllm.model_executor.loader import load_model
from pagedllm.worker.cuda_graphs import DecodeGraphRunner, graph_batch_sizes, padded_batch_size

from helpers.model_helpers import make_kv_caches, make_tiny_llama, paged_step

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (256, [1, 2, 4] + list(range(8, 257, 8))), (2000, [1, 2, 4] + list(range(8, 513, 8))),
])
def test_ladder(max_num_seqs: int, expected: list[int]) -> None:
    assert graph_batch_sizes(max_num_seqs) == expected


def test_padded_size() -> None:
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert padded_batch_size(65, sizes) is None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return load_model(ModelConfig(model=path, dtype="float32"), "cpu")


def test_padded_decode_equals_plain_step(model) -> None:
    block_size = 4
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    tables = [[1, 2], [3], [4, 5, 6]]
    bind_kv_caches(model, make_kv_caches(model.config, 8, block_size))
    paged_step(model, prompts, [len(p) for p in prompts], tables, block_size)  # fill the cache
    # One decode token per request, at the next position.
    new_tokens = [[21], [22], [23]]
    seq_lens = [len(p) + 1 for p in prompts]
    expected = paged_step(model, new_tokens, seq_lens, tables, block_size)

    runner = DecodeGraphRunner(model, torch.device("cpu"), graph_batch_sizes(8), max_blocks_per_seq=5,
                               block_size=block_size, hidden_size=model.config.hidden_size, dtype=torch.float32)
    meta = build_attention_metadata([1, 1, 1], seq_lens, tables, block_size)
    assert runner.can_run(meta)
    # Dirty the buffers first, so stale rows from a bigger earlier step would show.
    runner.input_ids.fill_(7)
    runner.block_tables.fill_(3)
    hidden = runner.run(torch.tensor([21, 22, 23]), torch.tensor([s - 1 for s in seq_lens]), meta)
    assert hidden.shape == (3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-5, rtol=1e-5)
    # Padded to 4 rows: the dummy row is token 0 at position 0, reading only the null block.
    assert runner.input_ids[3].item() == 0 and runner.seq_lens[3].item() == 1
    assert runner.block_tables[3].abs().sum().item() == 0
    assert runner.block_tables[0, 2:].abs().sum().item() == 0  # cleared past the step's table width


def test_rejects_steps_it_cannot_run(model) -> None:
    runner = DecodeGraphRunner(model, torch.device("cpu"), [1, 2], max_blocks_per_seq=2, block_size=4,
                               hidden_size=model.config.hidden_size, dtype=torch.float32)
    assert not runner.can_run(build_attention_metadata([1, 3], [5, 3], [[1, 2], [3]], 4))  # a prefill chunk
    assert not runner.can_run(build_attention_metadata([1, 1, 1], [2, 2, 2], [[1], [2], [3]], 4))  # too many
    assert not runner.can_run(build_attention_metadata([1], [12], [[1, 2, 3]], 4))  # table too wide


@pytest.mark.skipif(DEVICE != "cuda", reason="captures CUDA graphs (benchmarks/gpu_check.sh runs it on a GPU)")
def test_captured_graphs_replay_like_the_eager_step(tmp_path) -> None:
    """Capture the ladder, then replay padded decode steps of 3 and 1 requests: the same hidden states as the
    eager step (Triton kernels both ways; cuBLAS may tile a padded batch differently, hence the tolerance)."""
    dev = torch.device("cuda")
    model = load_model(ModelConfig(model=make_tiny_llama(tmp_path), dtype="float32"), dev)
    block_size = 4
    bind_kv_caches(model, [c.to(dev) for c in make_kv_caches(model.config, 16, block_size)])
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    tables = [[1, 2], [3], [4, 5, 6]]
    lens = [len(p) for p in prompts]
    positions = [p for n in lens for p in range(n)]
    with attention_step(build_attention_metadata(lens, lens, tables, block_size, dev), step_readers(model)):
        model(torch.tensor([t for p in prompts for t in p], device=dev), torch.tensor(positions, device=dev))

    runner = DecodeGraphRunner(model, dev, [1, 2, 4, 8], max_blocks_per_seq=5, block_size=block_size,
                               hidden_size=model.config.hidden_size, dtype=torch.float32)
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    seq_lens = [n + 1 for n in lens]
    steps = [([21, 22, 23], seq_lens, tables), ([23], seq_lens[2:], tables[2:])]
    for tokens, step_lens, step_tables in steps:
        ids = torch.tensor(tokens, device=dev)
        pos = torch.tensor([s - 1 for s in step_lens], device=dev)
        meta = build_attention_metadata([1] * len(tokens), step_lens, step_tables, block_size, dev)
        with attention_step(meta, step_readers(model)):
            expected = model(ids, pos).clone()  # writes the same K/V the replay writes again
        got = runner.run(ids, pos, meta)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
