"""CPU step graphs: the decode forward's kernel calls recorded once per batch size, replayed from C++.

On two cores a batch-1 decode step of the default model is ~300 kernel calls, and the Python and torch
dispatch between them cost a large share of the step (docs/performance.md). While a step graph records, every
C++ kernel keeps its arguments and runs as usual (``kernels/csrc/step_graph.h``); a replay calls the same kernels
on the same tensors in one C++ loop, with the GIL released. The CUDA graphs' buffers and padding
(``DecodeGraphRunner``) carry over: inputs live in persistent tensors, a step of ``n`` decodes is padded to the
next recorded size. With speculative decoding, steps verifying k drafts per request (k + 1 tokens each, the same
kernels) get graphs of their own (``StepGraphSet``), for every k up to the drafts per step and batches of up to
``VERIFY_GRAPH_MAX_TOKENS``.

A recording is only replayed when it is the whole computation: while it records, any torch op that computes
outside a kernel (an add, a copy, a fill, a oneDNN matmul of a bf16 model) refuses the capture, and so does a
kernel that allocates a result a replay would not refill. Each graph is then replayed once on other inputs and
must equal an eager forward bit for bit. Sizes record smallest first: a size refused leaves it and the bigger
batches eager (every batch, if it is the first size), with a log line saying why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm.logger import init_logger
from pagedllm.worker.cuda_graphs import DecodeGraphRunner, padded_batch_size

logger = init_logger(__name__)

# Batch sizes recorded: exact sizes up to 8, then 12 and 16 (a recording costs one forward and keeps that size's
# activations, and padding a CPU step costs real compute, unlike on a GPU): past 16 a padded graph gained nothing
# over the eager step and even an exact one little (docs/performance.md); bigger decode batches spend most of
# their time in the kernels anyway.
CPU_GRAPH_SIZES = [*range(1, 9), 12, 16]



def cpu_graph_sizes(max_num_seqs: int) -> list[int]:
    """The sizes to record for an engine running at most ``max_num_seqs`` requests: CPU_GRAPH_SIZES up to it, and
    ``max_num_seqs`` itself when it falls between two of them (so every decode batch it can run has a graph)."""
    sizes = [s for s in CPU_GRAPH_SIZES if s <= max_num_seqs]
    if max_num_seqs < CPU_GRAPH_SIZES[-1] and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


# aten ops that create tensors (torch.tensor is lift_fresh + detach_) without computing anything a replay redoes.
_ALLOCATIONS = {"empty.memory_format", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                "lift_fresh", "detach_"}


class GraphRefused(RuntimeError):
    """Raised while recording: something computed outside the C++ kernels, so a replay would miss it."""


class _OnlyKernels(TorchDispatchMode):
    """Lets views and allocations through; any other torch op outside a recorded kernel refuses the capture."""

    def __init__(self, kernels: Any) -> None:
        super().__init__()
        self.kernels = kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1]
        if not (func.is_view or name in _ALLOCATIONS or self.kernels.in_recorded_kernel()):
            raise GraphRefused(f"torch op {name} computes outside the C++ kernels")
        return func(*args, **(kwargs or {}))


class CpuDecodeGraphRunner(DecodeGraphRunner):
    """Steps of 1..16 requests of ``query_len`` tokens each (decodes; with ``query_len`` k + 1, steps verifying
    k drafts) replayed from recorded kernel calls (``capture`` records and checks)."""

    def __init__(self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], kernels: Any,
                 max_blocks_per_seq: int, block_size: int, hidden_size: int, dtype: torch.dtype,
                 sizes: list[int] | None = None, query_len: int = 1) -> None:
        super().__init__(model, torch.device("cpu"), sizes or CPU_GRAPH_SIZES, max_blocks_per_seq, block_size,
                         hidden_size, dtype, query_len=query_len)
        self.kernels = kernels
        self.outputs: dict[int, torch.Tensor] = {}

    def _record(self, size: int) -> tuple[Any, torch.Tensor]:
        """(the StepGraph of one forward over the buffers' first ``size`` rows, the tensor it writes)."""
        self.kernels.begin_step_graph()
        try:
            with _OnlyKernels(self.kernels):
                hidden = self._forward(size)
        finally:
            graph = self.kernels.end_step_graph()
        if graph.broken:
            raise GraphRefused(graph.broken)
        return graph, hidden

    def _matches_eager(self, size: int, graph: Any, hidden: torch.Tensor) -> bool:
        """Replay on other token ids (still dummy rows: null block 0) and compare with an eager forward."""
        tokens = size * self.query_len
        self.input_ids[:tokens] = torch.arange(1, tokens + 1)
        try:
            expected = self._forward(size).clone()
            graph.replay()
            return torch.equal(hidden, expected)
        finally:
            self.input_ids[:tokens].zero_()

    @torch.inference_mode()
    def capture(self) -> bool:
        """Record and check one graph per size, smallest first; False (no graphs: every step eager) if the first
        is refused. A bigger size refused keeps the smaller ones, and its batches and bigger ones run eagerly: in
        bf16 the kernel autotuner may give a matmul to oneDNN from some number of rows on, and a torch op cannot
        be recorded."""
        start = time.perf_counter()
        try:
            for size in self.sizes:
                graph, hidden = self._record(size)
                if not self._matches_eager(size, graph, hidden):
                    raise GraphRefused(f"the batch-{size} replay differs from the eager forward")
                self.graphs[size] = graph
                self.outputs[size] = hidden
        except GraphRefused as e:
            if not self.graphs:
                return self._refuse(f"CPU step graphs refused ({e}): decode steps run eagerly")
            self.sizes = sorted(self.graphs)  # what can_run and the padding see
            logger.info("CPU step graphs stop at batch %d (%s): bigger batches run eagerly", self.sizes[-1], e)
        except Exception as e:  # a forward that fails on the dummy rows: the engine still serves, eagerly
            return self._refuse(f"CPU step graphs not recorded: the forward failed on dummy rows ({e!r}); decode "
                                "steps run eagerly", logging.WARNING)
        ops = self.graphs[self.sizes[-1]].num_ops
        drafts = self.query_len - 1
        what = "decode batches" if not drafts else f"batches verifying {drafts} draft{'s' * (drafts > 1)} a request,"
        logger.info("recorded CPU step graphs for %s 1..%d (%d kernel calls at batch %d) in %.2f s",
                    what, self.sizes[-1], ops, self.sizes[-1], time.perf_counter() - start)
        return True

    def _refuse(self, message: str, level: int = logging.INFO) -> bool:
        self.graphs.clear()
        self.outputs.clear()
        logger.log(level, message)
        return False

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """hidden states [n * query_len, hidden_size] of a step of n requests (``can_run(meta)`` must hold):
        the inputs copied into the buffers, the recorded graph of the padded size replayed. The result is a view
        of that graph's output tensor, valid until its next replay."""
        size = padded_batch_size(meta.num_reqs, self.sizes)
        assert size is not None and self.can_run(meta)
        self._load(input_ids, positions, meta, size)
        self.graphs[size].replay()
        return self.outputs[size][:meta.num_actual_tokens]


class StepGraphSet:
    """The recorded step graphs of one engine, by query length: decodes (1) and, with speculation, draft
    verification (k + 1 for each k up to the drafts per step). What the runner asks: ``can_run`` / ``run``."""

    def __init__(self, runners: list[DecodeGraphRunner]) -> None:
        self.by_query_len = {r.query_len: r for r in runners}

    def _runner(self, meta: Any) -> DecodeGraphRunner | None:
        if meta.num_reqs == 0:
            return None
        runner = self.by_query_len.get(meta.num_actual_tokens // meta.num_reqs)
        return runner if runner is not None and runner.can_run(meta) else None

    def can_run(self, meta: Any) -> bool:
        return self._runner(meta) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        runner = self._runner(meta)
        assert runner is not None
        return runner.run(input_ids, positions, meta)


# Tokens per verification step recorded at most. A recording keeps its activations (~0.9 MB a token for the
# default model): up to 16 tokens, four draft counts (k = 1..4) held 154 MiB, against 17 MiB for all decode graphs;
# up to 8, about a third of it. The host time a graph saves is fixed per step, so its share shrinks as steps grow.
VERIFY_GRAPH_MAX_TOKENS = 8


def verification_graph_sizes(max_num_seqs: int, query_len: int) -> list[int]:
    """Batch sizes to record for steps verifying ``query_len - 1`` drafts per request: the decode sizes whose
    tokens stay within ``VERIFY_GRAPH_MAX_TOKENS``, so the set's memory and recording time stay bounded."""
    return [s for s in cpu_graph_sizes(max_num_seqs) if s * query_len <= VERIFY_GRAPH_MAX_TOKENS]
