"""CUDA graphs for decode steps: capture the model once per batch size of a ladder, replay per step.

A decode step of a small model is a few milliseconds of GPU work issued as hundreds of small kernel
launches; on a GPU the launches and the Python around them, not the arithmetic, set the step time. A CUDA
graph records those launches once and replays them with one call. Graphs need fixed shapes and fixed
addresses, so every input lives in a persistent buffer sized for the largest captured batch; a step of
``n`` decodes is padded to the next captured size, its inputs are copied into the buffers, and the padded
rows act as harmless dummy requests (one token at position 0, writing and reading only the null block 0).

Only steps where every request decodes one token go through graphs; steps with prefill chunks run eagerly.
(The CPU step graphs also record steps whose every request runs the same ``query_len`` tokens: verification of
k drafts, k + 1 tokens each.)
A hybrid model (several KV cache groups, Gemma 3) gets a block table and slot mapping buffer per group.
The same class runs without capturing (``capture=False``): that is how the CPU tests check the padding
and buffer logic that graphs rely on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.attention import StepReaders, attention_step, step_readers

logger = init_logger(__name__)


def graph_batch_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    """The ladder of decode batch sizes to capture: 1, 2, 4, then every multiple of 8 up to the cap.

    Padding a batch wastes at most 7 rows (or half of a batch below 8). The cap is the smaller of
    ``max_num_seqs`` and ``largest``; the result is ascending and always ends with the cap.
    """
    cap = max(1, min(max_num_seqs, largest))
    sizes = [s for s in (1, 2, 4) if s <= cap]
    sizes += list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` rows, or None if none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


class DecodeGraphRunner:
    """Persistent input buffers + one captured graph per batch size of steps whose every request runs
    ``query_len`` tokens: 1 for decode-only steps (the default), k + 1 for steps verifying k drafts each.

    ``model(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` (T = requests x ``query_len``) must read
    attention metadata from the forward context and never synchronise with the host or branch on tensor values
    (the Triton attention backend qualifies; the portable torch path does not, it sizes gathers on the host).
    """

    def __init__(self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                 sizes: list[int], max_blocks_per_seq: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype, num_kv_groups: int = 1, query_len: int = 1) -> None:
        self.model = model
        self.device = device
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.query_len = query_len
        n = self.sizes[-1]
        tokens = n * query_len
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(tokens, dtype=torch.long, device=device)
        # Dummy rows are whole: query_len tokens at positions 0.. in the null block.
        self.seq_lens = torch.full((n,), query_len, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device) * query_len
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Group 0's buffers are the two above; the groups share every other input.
        self.group_slot_mappings = [self.slot_mapping] + [torch.zeros_like(self.slot_mapping)
                                                          for _ in range(num_kv_groups - 1)]
        self.group_block_tables = [self.block_tables] + [torch.zeros_like(self.block_tables)
                                                         for _ in range(num_kv_groups - 1)]
        self.hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        # Who reads the buffers' metadata (step_readers of the model; none for a plain callable): found at the
        # first forward, after the engine bound the layers' caches and backends.
        self._readers: StepReaders | None = None

    @property
    def num_kv_groups(self) -> int:
        return len(self.group_block_tables)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a step whose every request runs ``query_len`` tokens, that fits the largest captured size
        and the block-table width, with one metadata per KV cache group of the captured model."""
        groups = _groups(meta)
        n = meta.num_reqs
        return (0 < n <= self.sizes[-1] and uniform_query_len(meta) == self.query_len
                and len(groups) == self.num_kv_groups
                and all(g.block_tables.shape[1] <= self.block_tables.shape[1] for g in groups))

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` rows of the buffers (what the graph of that size reads)."""
        return AttentionMetadata.over_buffers(size, self.group_slot_mappings, self.group_block_tables,
                                              self.query_start_loc, self.seq_lens, self.block_size,
                                              self.query_len)

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a step's inputs into the buffers; rows n..size-1 become dummy requests of ``query_len`` tokens."""
        n, q = meta.num_reqs, self.query_len
        t, padded = n * q, size * q
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.seq_lens[:n].copy_(meta.seq_lens)
        for group, slots, tables in zip(_groups(meta), self.group_slot_mappings, self.group_block_tables,
                                        strict=True):
            width = group.block_tables.shape[1]
            slots[:t].copy_(group.slot_mapping)
            tables[:n, :width].copy_(group.block_tables)
            tables[:n, width:].zero_()
            if size > n:
                slots[t:padded].zero_()
                tables[n:size].zero_()
        if size > n:  # dummy rows: token 0 at position 0 in slot 0 of the null block (in every group)
            self.input_ids[t:padded].zero_()
            self.positions[t:padded].zero_()
            self.seq_lens[n:size].fill_(q)

    def _forward(self, size: int) -> torch.Tensor:
        """An ordinary forward over the buffers' first ``size`` rows (a capture records it), its step prepared."""
        if self._readers is None:
            self._readers = step_readers(self.model) if isinstance(self.model, nn.Module) else []
        with attention_step(self._metadata(size), self._readers):
            tokens = size * self.query_len
            return self.model(self.input_ids[:tokens], self.positions[:tokens])

    def capture(self) -> None:
        """Record one graph per size, largest first so smaller ones reuse its memory pool. CUDA only."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up outside the graph: Triton compiles, allocators settle
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.hidden[:size * self.query_len] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s, %.0f MiB",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start, used / 2**20)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """hidden states [n * query_len, hidden_size] of a step of n requests (``can_run(meta)`` must hold).

        Replays the captured graph of the padded size; without captured graphs runs the padded batch eagerly.
        The result is a view of a persistent buffer, valid until the next call.
        """
        size = padded_batch_size(meta.num_reqs, self.sizes)
        assert size is not None and self.can_run(meta)
        self._load(input_ids, positions, meta, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self.hidden[:size * self.query_len] = self._forward(size)
        return self.hidden[:meta.num_actual_tokens]


def uniform_query_len(meta: AttentionMetadata) -> int | None:
    """The number of tokens every request of the step runs, or None when they differ."""
    if meta.num_decodes == meta.num_reqs:
        return 1
    if meta.num_decodes:  # one-token requests beside longer ones
        return None
    qsl = meta.query_start_loc_cpu
    q = qsl[1] - qsl[0]
    return q if all(qsl[i + 1] - qsl[i] == q for i in range(1, meta.num_reqs)) else None


def _groups(meta: AttentionMetadata) -> list[AttentionMetadata]:
    """A step's metadata per KV cache group (one group: the step's own)."""
    return meta.group_metadata if meta.group_metadata is not None else [meta]
