"""Per-step attention metadata: how the flat token batch maps onto requests and KV cache slots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.host_to_device import tensor_on, to_device


@dataclass
class AttentionMetadata:
    """Describes one forward step to the attention backend.

    Requests are ordered decodes first (query length 1), then prefills/chunks (query length > 1).
    All tensors live on the model's device.

    Attributes:
        num_actual_tokens: T, the number of tokens in the flat batch.
        slot_mapping: [T] int64, KV slot of each token (``block_id * block_size + offset``).
        query_start_loc: [R + 1] int32, offsets of each request's tokens in the flat batch.
        seq_lens: [R] int32, tokens in each request's KV cache after this step (context + new).
        block_tables: [R, max_blocks] int32, physical block ids per request (0-padded).
        num_decodes: number of leading requests with exactly one query token.
        query_start_loc_cpu / seq_lens_cpu: host copies, used to loop over prefills without syncs.
        max_decode_seq_len: longest ``seq_len`` among the decodes (sizes the gather).
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_decode_seq_len: int
    block_size: int
    # A model with several KV cache groups: every group's metadata, this one (group 0) first; the groups
    # differ only in block_tables and slot_mapping. None: one group, or all groups share this table.
    group_metadata: list[AttentionMetadata] | None = field(default=None, repr=False)
    # What a backend derives from this step once and every layer reuses (its plan of the batch), under the
    # backend's own key: the metadata describes the step, each backend keeps its own state here.
    backend_state: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _max_query_len: int | None = field(default=None, init=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def max_query_len(self) -> int:
        """The most new tokens of one request in this step (0 for an empty step); computed once per step, not
        once per layer."""
        if self._max_query_len is None:
            qsl = self.query_start_loc_cpu
            self._max_query_len = max((qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)), default=0)
        return self._max_query_len


def token_positions(query_lens: list[int], seq_lens: list[int]) -> np.ndarray:
    """[T] int64 position of every new token: request i's ``query_lens[i]`` tokens end at ``seq_lens[i] - 1``."""
    q = np.asarray(query_lens, dtype=np.int64)
    starts = np.asarray(seq_lens, dtype=np.int64) - q
    qsl = np.concatenate([[0], np.cumsum(q)])
    row_of_token = np.repeat(np.arange(len(q)), q)
    return np.arange(int(qsl[-1]), dtype=np.int64) - qsl[row_of_token] + starts[row_of_token]


def build_attention_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]] | np.ndarray,
                             block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """The one metadata builder (model runner and tests alike).

    Requests must come decodes first. ``query_lens[i]`` new tokens of request i end at position
    ``seq_lens[i] - 1``; ``block_tables``: per request its physical block ids (ragged lists, or an
    [R, max_blocks] int32 array already 0-padded).
    """
    num_reqs = len(query_lens)
    num_decodes = 0
    while num_decodes < num_reqs and query_lens[num_decodes] == 1:
        num_decodes += 1
    if any(q == 1 for q in query_lens[num_decodes:]):
        raise ValueError("attention metadata: requests must be ordered decodes (one query token) first")
    if isinstance(block_tables, np.ndarray):
        tables = block_tables.astype(np.int32, copy=False)
    else:
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = np.zeros((num_reqs, width), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    row_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = token_positions(query_lens, seq_lens)
    # Tokens past a request's table get slot -1 (encoder layers keep no cache and pass empty tables).
    block_idx = positions // block_size
    in_table = block_idx < tables.shape[1]
    slot_mapping = np.where(in_table, tables[row_of_token, np.minimum(block_idx, tables.shape[1] - 1)].astype(np.int64)
                            * block_size + positions % block_size, -1)
    qsl_list = qsl.tolist()
    seq_list = [int(s) for s in seq_lens]
    return AttentionMetadata(
        num_actual_tokens=qsl_list[-1],
        # Queued without a stream sync on CUDA (host_to_device.py).
        slot_mapping=to_device(torch.from_numpy(slot_mapping), device),
        query_start_loc=tensor_on(qsl_list, torch.int32, device),
        seq_lens=tensor_on(seq_list, torch.int32, device),
        block_tables=to_device(torch.from_numpy(np.ascontiguousarray(tables)), device),
        num_decodes=num_decodes,
        query_start_loc_cpu=qsl_list,
        seq_lens_cpu=seq_list,
        max_decode_seq_len=max(seq_list[:num_decodes], default=0),
        block_size=block_size,
    )
