"""Owns structured outputs for the engine: the compile cache and thread pool, one matcher per request, the
per-step bitmask, and advancing the matchers with the tokens the engine actually kept.

Compilation never runs on the engine loop: a request whose grammar is not compiled yet waits in
``RequestStatus.WAITING_FOR_GRAMMAR`` (the scheduler skips it) until ``poll`` sees its future done.
Matchers advance only after a step succeeded (a failed step's tokens are dropped, so must its grammar
moves); preemption keeps the output tokens and so keeps the matcher as it is.

Where a CPU is spare (more usable CPUs than torch's intra-op threads, e.g. a GPU host), the step's bitmask
is filled on a background thread while the model runs its forward pass (xgrammar releases the GIL): the
matchers' state is final once the previous step's tokens were accepted, and the sampler needs the bitmask
only after the forward. ``sched.grammar_bitmask`` is then a Future the model runner resolves. Without a
spare CPU the fill runs before the forward: a thread competing with torch's OpenMP workers for their cores
stalls every parallel region of the forward for longer than the fill itself takes (measured on 2 cores).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from pagedllm.core.request import RequestStatus
from pagedllm.logger import init_logger
from pagedllm.structured_output.params import GrammarKey, StructuredOutputsParams
from pagedllm.structured_output.reasoning_gate import ReasoningGate

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.structured_output.backend import XgrammarBackend

logger = init_logger(__name__)

# Compiled grammars kept (least recently used dropped first); a JSON-schema grammar is tens of KB.
MAX_CACHED_GRAMMARS = 512


class StructuredOutputManager:
    """Thread-safe for ``compile``/``validate`` (the API side calls them); the rest runs on the engine loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_workers: int = 1,
                 overlap_fill: bool | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.num_compiles = 0
        self._waiting: dict[str, tuple[Request, Future]] = {}
        self._matchers: dict[str, Any] = {}
        # Requests of a reasoning model (SamplingParams.reasoning): their grammar waits for the thinking to end.
        self._gates: dict[str, ReasoningGate] = {}
        # overlap_fill: fill the bitmask on a thread during the forward pass (False: before it; None: when
        # a CPU is spare, decided at the first fill).
        self.overlap_fill = overlap_fill
        self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-bitmask")
        self._pending_fill: Future | None = None
        self._bitmask_buffer: Any = None  # reused [rows, ceil(V/32)] int32, grown on demand

    # ---- compiling (any thread) ---------------------------------------------------------------------
    def backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from pagedllm.structured_output.backend import XgrammarBackend

                self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self._stop_token_ids)
            return self._backend

    def _compile_now(self, key: GrammarKey) -> Any:
        self.num_compiles += 1
        compiled = self.backend().compile(key)
        logger.debug("compiled %s grammar (%d chars of spec)", key.kind, len(key.spec))
        return compiled

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The (possibly already finished) future of this grammar's compilation; starts it if new."""
        key = params.key()
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile_now, key)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        # A failed compile is not kept: the error is reported to its request, the next one tries again.
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(key, f))
        return future

    def _forget(self, key: GrammarKey, future: Future) -> None:
        with self._cache_lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def validate(self, params: StructuredOutputsParams, timeout: float | None = None) -> None:
        """Compile (or find cached) and raise ValueError naming the field if the backend rejects it.

        Blocks the calling thread: the API side calls it in a worker thread before submitting, so the
        engine then finds the grammar compiled.
        """
        self.compile(params).result(timeout)

    # ---- engine loop --------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Start compiling its grammar; the request waits in WAITING_FOR_GRAMMAR until it is ready."""
        if request.sampling_params.reasoning is not None:
            self._gates[request.request_id] = ReasoningGate(request.sampling_params.reasoning)
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        self._waiting[request.request_id] = (request, self.compile(params))
        request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def poll(self, timeout: float = 0.0) -> list[tuple[Request, str]]:
        """Move requests whose grammar compiled to WAITING (with a fresh matcher). Returns (request, error)
        for those whose compilation failed, for the engine to finish. ``timeout``: wait at most this long
        for one pending compile (the engine passes a little when it has nothing else to run)."""
        failed: list[tuple[Request, str]] = []
        if timeout > 0 and self._waiting:
            wait([f for _, f in self._waiting.values()], timeout=timeout, return_when=FIRST_COMPLETED)
        for req_id, (request, future) in list(self._waiting.items()):
            if request.is_finished:  # aborted while compiling
                del self._waiting[req_id]
                continue
            if not future.done():
                continue
            del self._waiting[req_id]
            error = future.exception()
            if error is not None:
                failed.append((request, str(error)))
                continue
            self._matchers[req_id] = self.backend().new_matcher(future.result())
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING
        return failed

    def fill_bitmask(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Set ``sched.structured_output_request_ids`` and ``sched.grammar_bitmask`` [M, ceil(V/32)] int32
        for the scheduled requests with a grammar that sample this step (partial prefill chunks do not).

        With ``overlap_fill`` the bitmask is a Future of that tensor, filling while the forward runs
        (``resolve_bitmask`` waits for it); it stays valid until the next call."""
        if not self._matchers and not self._gates:
            return
        rows, forced_rows, forced, extra = [], [], [], {}
        for req_id in sched.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.num_computed_tokens < request.num_tokens:
                continue
            gate = self._gates.get(req_id)
            if gate is not None and not gate.done:
                # Thinking: no grammar yet, unless a marker must be finished; before the first token the
                # grammar's tokens and the start marker are both allowed.
                token = gate.forced_token()
                if token is not None:
                    forced_rows.append(req_id)
                    forced.append(token)
                elif gate.opening_token() is not None and req_id in self._matchers:
                    extra[len(rows)] = gate.opening_token()
                    rows.append(req_id)
            elif req_id in self._matchers:
                rows.append(req_id)
        if not rows and not forced_rows:
            return
        self._wait_for_fill()  # the buffer is free again (the last step's fill is long done in practice)
        bitmask = self._bitmask_rows(len(rows) + len(forced_rows))
        matchers = [self._matchers[req_id] for req_id in rows]
        sched.structured_output_request_ids = rows + forced_rows
        if self.overlap_fill is None:
            self.overlap_fill = _cpu_is_spare()
            logger.info("grammar bitmask fill %s the forward pass", "overlaps" if self.overlap_fill else "precedes")
        if self.overlap_fill:
            self._pending_fill = self._fill_pool.submit(self._fill, matchers, bitmask, forced, extra)
            sched.grammar_bitmask = self._pending_fill
        else:
            sched.grammar_bitmask = self._fill(matchers, bitmask, forced, extra)

    def _fill(self, matchers: list[Any], bitmask: Any, forced: list[int] | None = None,
              extra: dict[int, int] | None = None) -> Any:
        """Rows of the grammar ``matchers`` (row -> one more allowed token in ``extra``), then one row per
        ``forced`` token id that allows only it."""
        if matchers:
            self.backend().fill_bitmask(matchers, bitmask[:len(matchers)])
        for row, token in (extra or {}).items():
            bitmask[row, token // 32] |= _bit(token)
        for row, token in enumerate(forced or (), start=len(matchers)):
            bitmask[row].zero_()
            bitmask[row, token // 32] = _bit(token)
        return bitmask

    def _bitmask_rows(self, rows: int) -> Any:
        """The first ``rows`` rows of the reused bitmask buffer (a fresh allocation per step cost page faults)."""
        if self._bitmask_buffer is None or self._bitmask_buffer.shape[0] < rows:
            self._bitmask_buffer = self.backend().allocate_bitmask(max(rows, 64))
        return self._bitmask_buffer[:rows]

    def _wait_for_fill(self) -> None:
        """Matchers must not move, nor the buffer be refilled, while a fill still reads them."""
        pending, self._pending_fill = self._pending_fill, None
        if pending is not None:
            wait([pending])  # its error, if any, was raised to the step that used it

    def accept_tokens(self, result: ModelRunnerOutput) -> set[str]:
        """Advance each matcher by its request's kept tokens (a list per request: one, or several when
        drafts were accepted); returns the requests whose grammar has ended (terminated, or a token was
        rejected: the engine finishes them with "stop")."""
        self._wait_for_fill()
        ended = set()
        for req_id in list(self._gates) + [r for r in self._matchers if r not in self._gates]:
            tokens = result.sampled_token_ids.get(req_id) or ()
            gate = self._gates.get(req_id)
            if gate is not None:
                tokens = [t for token in tokens for t in gate.accept(token)]  # the answer's tokens only
            matcher = self._matchers.get(req_id)
            if matcher is None:
                continue
            for token in tokens:
                if not matcher.accept_token(token):
                    logger.warning("request %s: token %d is not allowed by its grammar; ending it", req_id, token)
                    ended.add(req_id)
                    break
                if matcher.is_terminated():
                    ended.add(req_id)
                    break
        return ended

    def remove_finished(self, live: dict[str, Request]) -> None:
        """Drop matchers of requests that finished or were aborted (no longer in ``live``)."""
        for req_id in [r for r in self._matchers if r not in live]:
            del self._matchers[req_id]
        for req_id in [r for r in self._gates if r not in live]:
            del self._gates[req_id]

    def num_matchers(self) -> int:
        return len(self._matchers)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=True)


def _bit(token: int) -> int:
    """The int32 word value with only ``token``'s bit set (bit 31 is the sign bit)."""
    return (1 << (token % 32)) - (1 << 32 if token % 32 == 31 else 0)


def resolve_bitmask(bitmask: Any) -> Any:
    """``sched.grammar_bitmask`` as a tensor: waits for the background fill when it is a Future."""
    return bitmask.result() if isinstance(bitmask, Future) else bitmask


def _cpu_is_spare() -> bool:
    """More usable CPUs than torch's intra-op threads: a fill thread then does not steal a forward's core."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus > torch.get_num_threads()
