"""attention/metadata.py is the one place that constructs ``AttentionMetadata``: an AST count over pagedllm/
holds it at one, and each constructor there gives the fields the code it replaced built by hand (the
reference constructions below are that code, kept as it was)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata
from pagedllm.host_to_device import tensor_on, to_device
from pagedllm.worker.cuda_graphs import DecodeGraphRunner
from pagedllm.worker.encoder_decoder import EncoderDecoderRunner
from pagedllm.worker.model_runner import CachedRequestState
from pagedllm.worker.pooling_runner import encoder_inputs

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"
FIELDS = ("num_actual_tokens", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "num_decodes",
          "query_start_loc_cpu", "seq_lens_cpu", "max_decode_seq_len", "block_size")


def construction_sites(root: Path) -> list[str]:
    """``path:line`` of every call of ``AttentionMetadata(...)`` (by name or attribute) under ``root``."""
    sites = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "AttentionMetadata":
                    sites.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return sites


def test_metadata_is_constructed_in_one_place() -> None:
    sites = construction_sites(PACKAGE)
    assert len(sites) == 1 and sites[0].startswith("attention/metadata.py:"), sites


def test_the_count_sees_a_construction(tmp_path: Path) -> None:  # the count above must be able to fail
    source = "import m\n\ndef f():\n    return m.AttentionMetadata(1), AttentionMetadata()\n"
    (tmp_path / "runner.py").write_text(source)
    assert construction_sites(tmp_path) == ["runner.py:4", "runner.py:4"]


def assert_same_fields(got: AttentionMetadata, expected: AttentionMetadata) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(expected, name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, name
            assert torch.equal(a, b), name
        else:
            assert type(a) is type(b) and a == b, name
    assert got.group_metadata is None and expected.group_metadata is None
    assert got.backend_state == {}


def test_for_step_is_the_public_builder() -> None:
    assert build_attention_metadata == AttentionMetadata.for_step
    meta = build_attention_metadata([1, 1, 3], [5, 2, 7], [[1, 2], [3], [4, 5]], 4)
    assert meta.num_actual_tokens == 5 and meta.num_decodes == 2 and meta.max_decode_seq_len == 5
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 3 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]
    assert meta.block_tables.tolist() == [[1, 2], [3, 0], [4, 5]]


def test_over_buffers_matches_the_graph_runners_construction() -> None:
    runner = DecodeGraphRunner(lambda ids, pos: ids, torch.device("cpu"), [1, 2, 4], max_blocks_per_seq=3,
                               block_size=4, hidden_size=8, dtype=torch.float32, num_kv_groups=2)
    size = 2
    metas = [AttentionMetadata(
        num_actual_tokens=size, slot_mapping=slots[:size],
        query_start_loc=runner.query_start_loc[:size + 1], seq_lens=runner.seq_lens[:size],
        block_tables=tables[:size], num_decodes=size,
        query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[1] * size,
        max_decode_seq_len=tables.shape[1] * runner.block_size, block_size=runner.block_size)
        for slots, tables in zip(runner.group_slot_mappings, runner.group_block_tables, strict=True)]
    got = runner._metadata(size)
    assert got.group_metadata is not None and len(got.group_metadata) == 2 and got.group_metadata[0] is got
    for g, (new, old) in enumerate(zip(got.group_metadata, metas, strict=True)):
        new_groups, new.group_metadata = new.group_metadata, None
        assert_same_fields(new, old)
        new.group_metadata = new_groups
        # Views over the persistent buffers (what a captured graph reads), not copies.
        assert new.block_tables.data_ptr() == runner.group_block_tables[g].data_ptr()
        assert new.slot_mapping.data_ptr() == runner.group_slot_mappings[g].data_ptr()
    one = DecodeGraphRunner(lambda ids, pos: ids, torch.device("cpu"), [1, 2], max_blocks_per_seq=3,
                            block_size=4, hidden_size=8, dtype=torch.float32)
    assert one._metadata(1).group_metadata is None


def _state(tokens: list[int]) -> CachedRequestState:
    return CachedRequestState("r", list(tokens), list(tokens), None, ([],), 0)


def test_encoder_only_matches_the_pooling_runners_construction() -> None:
    query_lens = [3, 1, 4]
    states = [_state(range(10, 13)), _state([20]), _state(range(30, 34))]
    device = torch.device("cpu")
    qsl = [0, 3, 4, 8]
    expected = AttentionMetadata(
        num_actual_tokens=qsl[-1], slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(states), 0), dtype=torch.int32, device=device),
        num_decodes=0, query_start_loc_cpu=qsl, seq_lens_cpu=list(query_lens), max_decode_seq_len=0,
        block_size=0)
    meta, ids, positions = encoder_inputs(states, query_lens, device)
    assert_same_fields(meta, expected)
    assert ids.tolist() == [10, 11, 12, 20, 30, 31, 32, 33]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_cross_attention_matches_the_encoder_decoder_runners_construction() -> None:
    device = torch.device("cpu")
    positions, block_size = 10, 4
    runner = EncoderDecoderRunner(torch.nn.Identity(), 1, positions, block_size, device)
    for query_lens, seq_lens in (([1, 1], [6, 3]), ([1, 3], [6, 3])):
        decoder = build_attention_metadata(query_lens, seq_lens, [[1, 2], [3]], block_size)
        block_tables = [[7, 8, 9], [10, 11]]
        tables = np.zeros((2, 3), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table
        seq = [positions] * 2
        expected = AttentionMetadata(
            num_actual_tokens=decoder.num_actual_tokens, slot_mapping=decoder.slot_mapping,
            query_start_loc=decoder.query_start_loc, seq_lens=tensor_on(seq, torch.int32, device),
            block_tables=to_device(torch.from_numpy(tables), device), num_decodes=decoder.num_decodes,
            query_start_loc_cpu=decoder.query_start_loc_cpu, seq_lens_cpu=seq,
            max_decode_seq_len=positions if decoder.num_decodes else 0, block_size=block_size)
        got = runner.cross_metadata(block_tables, decoder)
        assert_same_fields(got, expected)
        assert got.slot_mapping is decoder.slot_mapping and got.query_start_loc is decoder.query_start_loc
