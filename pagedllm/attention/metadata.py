"""Per-step attention metadata: how the flat token batch maps onto requests and KV cache slots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, cast

import numpy as np
import torch

from pagedllm.host_to_device import tensor_on, to_device

StateT = TypeVar("StateT")


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
    # Runs of image tokens that attend to each other both ways (Gemma 3), each (request index, first row, end row
    # in the flat batch, position that ends the run): those rows also see the run's later keys. Set by the model
    # runner on every group's metadata of a step that computes such a run whole; None: plain causal.
    bidirectional_runs: list[tuple[int, int, int, int]] | None = field(default=None, repr=False)
    # What a backend derives from this step once and every layer reuses (its plan of the batch), keyed by the
    # backend's state class (``AttentionBackend.state_type``): the metadata describes the step, each backend keeps
    # its own state here. Written by ``AttentionBackend.prepare_step`` only; read through ``step_state``.
    backend_state: dict[type, object] = field(default_factory=dict, init=False, repr=False)
    _max_query_len: int | None = field(default=None, init=False, repr=False)

    @classmethod
    def for_step(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]] | np.ndarray,
                 block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """A step's metadata from its lengths and block tables (model runner, profiling step, draft model, tests).

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
            tables = _padded_tables(block_tables, min_width=1)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        row_of_token = np.repeat(np.arange(num_reqs), query_lens)
        positions = token_positions(query_lens, seq_lens)
        # Tokens past a request's table get slot -1 (encoder layers keep no cache and pass empty tables).
        block_idx = positions // block_size
        in_table = block_idx < tables.shape[1]
        slot_mapping = np.where(in_table, tables[row_of_token, np.minimum(block_idx, tables.shape[1] - 1)]
                                .astype(np.int64) * block_size + positions % block_size, -1)
        qsl_list = qsl.tolist()
        seq_list = [int(s) for s in seq_lens]
        return _assemble(
            # Queued without a stream sync on CUDA (host_to_device.py).
            slot_mapping=to_device(torch.from_numpy(slot_mapping), device),
            query_start_loc=tensor_on(qsl_list, torch.int32, device),
            seq_lens=tensor_on(seq_list, torch.int32, device),
            block_tables=to_device(torch.from_numpy(np.ascontiguousarray(tables)), device),
            num_decodes=num_decodes, query_start_loc_cpu=qsl_list, seq_lens_cpu=seq_list, block_size=block_size)

    @classmethod
    def over_buffers(cls, size: int, slot_mappings: list[torch.Tensor], block_tables: list[torch.Tensor],
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     query_len: int = 1) -> AttentionMetadata:
        """A step of ``size`` requests of ``query_len`` tokens each (1: decodes; k + 1: verifying k drafts) as
        views over persistent buffers (what a recorded step graph reads), one metadata per KV cache group:
        group g's over ``slot_mappings[g]`` ([N * query_len] int64) and ``block_tables[g]`` ([N, max_blocks]
        int32), all over ``query_start_loc`` ([N + 1] int32, multiples of ``query_len``) and ``seq_lens`` ([N]
        int32), N >= ``size``. Returns group 0's, carrying the others when there are several.

        The host lists describe the shapes, not the lengths: graph-safe backends read the device tensors only.
        ``max_decode_seq_len`` (the table's whole width) bounds a gather nobody does under a graph.
        """
        tokens = size * query_len
        metas = [_assemble(slot_mapping=slots[:tokens], query_start_loc=query_start_loc[:size + 1],
                           seq_lens=seq_lens[:size], block_tables=tables[:size],
                           num_decodes=size if query_len == 1 else 0,
                           query_start_loc_cpu=list(range(0, tokens + 1, query_len)), seq_lens_cpu=[query_len] * size,
                           max_decode_seq_len=tables.shape[1] * block_size, block_size=block_size)
                 for slots, tables in zip(slot_mappings, block_tables, strict=True)]
        return link_groups(metas)

    @classmethod
    def encoder_only(cls, query_lens: list[int], device: torch.device | str) -> AttentionMetadata:
        """An encoder step of whole sequences of ``query_lens`` tokens: their offsets and lengths only (no KV
        cache: empty slot mapping, [R, 0] block tables, block size 0; no request counts as a decode)."""
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return _assemble(
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
            block_tables=torch.zeros((len(query_lens), 0), dtype=torch.int32, device=device),
            num_decodes=0, query_start_loc_cpu=qsl, seq_lens_cpu=list(query_lens), block_size=0)

    @classmethod
    def cross_attention(cls, decoder_meta: AttentionMetadata, block_tables: list[list[int]], encoder_len: int,
                        block_size: int, device: torch.device | str) -> AttentionMetadata:
        """The cross-attention KV cache group's metadata for a step whose decoder metadata is ``decoder_meta``:
        the decoder's query layout, the requests' cross-attention ``block_tables`` (same order) and
        ``seq_len`` = ``encoder_len`` for each. Nothing is written through it (its slot_mapping is the
        decoder's, unused)."""
        seq_lens = [encoder_len] * len(block_tables)
        tables = _padded_tables(block_tables, min_width=0)
        return _assemble(
            slot_mapping=decoder_meta.slot_mapping, query_start_loc=decoder_meta.query_start_loc,
            seq_lens=tensor_on(seq_lens, torch.int32, device),
            block_tables=to_device(torch.from_numpy(tables), device), num_decodes=decoder_meta.num_decodes,
            query_start_loc_cpu=decoder_meta.query_start_loc_cpu, seq_lens_cpu=seq_lens, block_size=block_size)

    def for_group(self, group: int) -> AttentionMetadata:
        """KV cache group ``group``'s metadata of this step (this is group 0's; one group: itself)."""
        if group and self.group_metadata is not None:
            return self.group_metadata[group]
        return self

    def step_state(self, state_type: type[StateT]) -> StateT:
        """The per-step state of type ``state_type`` that a backend's ``prepare_step`` built for this step.

        Raises RuntimeError when none was prepared: whoever builds metadata and runs layers over it prepares the
        step first (``model_executor.layers.attention``: ``prepare_step_states``, ``attention_step``).
        """
        state = self.backend_state.get(state_type)
        if state is None:
            raise RuntimeError(
                f"attention: this step's metadata holds no {state_type.__name__}; the step was not prepared. "
                "Whoever builds AttentionMetadata and runs layers over it calls prepare_step_states(meta, "
                "step_readers(model)) (or enters attention_step(meta, readers)) before the forward")
        return cast(StateT, state)  # prepare_step keys each state by its own class

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


def link_groups(metas: list[AttentionMetadata]) -> AttentionMetadata:
    """Group 0's metadata of a step with one metadata per KV cache group, carrying every group's when there
    are several (each layer then reads its group's: ``forward_context.get_attn_metadata``)."""
    if len(metas) > 1:
        metas[0].group_metadata = metas
    return metas[0]


#: The public name of ``AttentionMetadata.for_step``: the one builder of a step's metadata from lengths and tables.
build_attention_metadata = AttentionMetadata.for_step


def _padded_tables(block_tables: list[list[int]], min_width: int) -> np.ndarray:
    """Ragged per-request block ids -> [R, max(longest, min_width)] int32, 0-padded (block 0 is the null block)."""
    width = max((len(t) for t in block_tables), default=min_width) or min_width
    tables = np.zeros((len(block_tables), width), dtype=np.int32)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table
    return tables


def _assemble(*, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_tables: torch.Tensor, num_decodes: int, query_start_loc_cpu: list[int], seq_lens_cpu: list[int],
              block_size: int, max_decode_seq_len: int | None = None) -> AttentionMetadata:
    """The one construction of ``AttentionMetadata`` (``tests/attention/test_metadata_constructors.py`` holds
    the count at one): every constructor above ends here. ``num_actual_tokens`` is the host offsets' last;
    ``max_decode_seq_len`` by default the longest ``seq_len`` among the decodes."""
    if max_decode_seq_len is None:
        max_decode_seq_len = max(seq_lens_cpu[:num_decodes], default=0)
    return AttentionMetadata(
        num_actual_tokens=query_start_loc_cpu[-1], slot_mapping=slot_mapping, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=block_tables, num_decodes=num_decodes,
        query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu, max_decode_seq_len=max_decode_seq_len,
        block_size=block_size)
