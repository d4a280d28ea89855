"""Front-end output processing: engine-core outputs → detokenized ``RequestOutput``s.

Stop strings are found here; the engine core is told to finish those requests.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.processor import child_request_id
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (offline generate)


@dataclass
class _ChildState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_token_start: int = 0  # first token not yet handed out (DELTA)
    new_logprob_start: int = 0


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    children: dict[str, _ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0
    kv_transfer_params: dict | None = None  # from the KV connector when the request finished


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}
        # Pooling requests: id -> (prompt, prompt token ids, metrics). No children, nothing to detokenize.
        self.pooling: dict[str, tuple[str | None, list[int], RequestMetrics]] = {}

    def add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                            arrival_time: float) -> None:
        self.pooling[request_id] = (prompt, prompt_token_ids, RequestMetrics(arrival_time))

    def _pooling_output(self, request_id: str, finish_reason: str | None, data: Any = None) -> PoolingRequestOutput:
        prompt, token_ids, metrics = self.pooling.pop(request_id)
        metrics.finished_time = time.time()
        return PoolingRequestOutput(request_id, PoolingOutput(data) if data is not None else None, token_ids,
                                    True, prompt, finish_reason, metrics)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, kind: OutputKind, arrival_time: float) -> None:
        children = {}
        for i in range(params.n):
            cid = child_request_id(request_id, i, params.n)
            children[cid] = _ChildState(
                i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.child_to_parent[cid] = request_id
        self.parents[request_id] = _ParentState(
            request_id, prompt, prompt_token_ids, params, kind, children, RequestMetrics(arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def child_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooling:
            return [request_id]
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def abort(self, request_id: str) -> None:
        self.pooling.pop(request_id, None)
        parent = self.parents.pop(request_id, None)
        if parent:
            for cid in parent.children:
                self.child_to_parent.pop(cid, None)

    def _to_logprobs(self, entries: list[dict[int, tuple[float, int]]]) -> list[dict[int, Logprob]]:
        out = []
        for entry in entries:
            out.append({tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, (lp, rank) in entry.items()})
        return out

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out and the child ids the engine must stop (stop strings)."""
        now = time.time()
        touched: dict[str, _ParentState] = {}
        to_stop: list[str] = []
        pooled: list[PoolingRequestOutput] = []
        for out in outputs:
            if out.req_id in self.pooling:
                if out.finish_reason is not None:
                    pooled.append(self._pooling_output(out.req_id, out.finish_reason, out.pooling_output))
                continue
            parent_id = self.child_to_parent.get(out.req_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            child = parent.children[out.req_id]
            if child.finish_reason is not None:
                # Finished by a stop string earlier in this batch (outputs of several engine steps can arrive
                # together): the engine's later tokens for it are past the stop and must not count it twice.
                continue
            touched[parent_id] = parent
            if out.kv_transfer_params is not None:
                parent.kv_transfer_params = out.kv_transfer_params
            if out.prompt_logprobs and parent.prompt_logprobs is not None and child.index == 0:
                parent.prompt_logprobs.extend(self._to_logprobs(out.prompt_logprobs))
            if not out.new_token_ids:
                if out.finish_reason is not None:
                    child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
                    parent.num_finished += 1
                continue
            parent.num_cached_tokens = out.num_cached_tokens
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            # A step may bring several tokens (speculative decoding): look for stop strings token by
            # token and drop whatever follows the token that completed one.
            new_ids, stop_str = out.new_token_ids, None
            for count, token_id in enumerate(out.new_token_ids, 1):
                stop_str = child.detok.update([token_id])
                if stop_str is not None:
                    new_ids = out.new_token_ids[:count]
                    break
            child.token_ids.extend(new_ids)
            if child.logprobs is not None and out.new_logprobs:
                lps = self._to_logprobs(out.new_logprobs[:len(new_ids)])
                child.logprobs.extend(lps)
                for tid, lp in zip(new_ids, lps):
                    child.cumulative_logprob += lp[tid].logprob
            if stop_str is not None:
                child.finish_reason, child.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    to_stop.append(out.req_id)
            elif out.finish_reason is not None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            if child.finish_reason is not None:
                parent.num_finished += 1

        results = []
        for parent_id, parent in touched.items():
            finished = parent.num_finished == len(parent.children)
            if finished:
                parent.metrics.finished_time = now
                self.abort(parent_id)
            if parent.kind == OutputKind.FINAL_ONLY and not finished:
                continue
            results.append(self._make_output(parent, finished))
        return (pooled + results if pooled else results), to_stop

    def make_abort_output(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        """A final output for a request aborted from outside, marking unfinished children 'abort'."""
        if request_id in self.pooling:
            return self._pooling_output(request_id, "abort")
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children.values():
            if child.finish_reason is None:
                child.finish_reason = "abort"
        parent.metrics.finished_time = time.time()
        self.abort(request_id)
        return self._make_output(parent, True)

    def _make_output(self, parent: _ParentState, finished: bool) -> RequestOutput:
        delta = parent.kind == OutputKind.DELTA
        completions = []
        for child in sorted(parent.children.values(), key=lambda c: c.index):
            text = child.detok.get_delta(child.finish_reason is not None) if delta else child.detok.output_text
            if delta:
                token_ids = child.token_ids[child.new_token_start:]
                child.new_token_start = len(child.token_ids)
                logprobs = None
                if child.logprobs is not None:
                    logprobs = child.logprobs[child.new_logprob_start:]
                    child.new_logprob_start = len(child.logprobs)
            else:
                token_ids, logprobs = list(child.token_ids), child.logprobs
            completions.append(CompletionOutput(
                index=child.index, text=text, token_ids=token_ids,
                cumulative_logprob=child.cumulative_logprob, logprobs=logprobs,
                finish_reason=child.finish_reason, stop_reason=child.stop_reason))
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=completions, finished=finished, prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens, metrics=parent.metrics,
            kv_transfer_params=parent.kv_transfer_params)
