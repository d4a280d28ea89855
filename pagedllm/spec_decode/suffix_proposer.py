"""Suffix decoding (``"method": "suffix"``): drafts from the request's own text and from recent answers.

Two suffix indexes (``suffix_index.py``) answer each step: the request's own, over its prompt and its output so
far (what prompt lookup sees, but drafting the most frequent continuation rather than the latest one), and a global
one over the outputs of the last ``max_cached_requests`` finished requests (agent loops, repeated and templated
requests answer alike). The draft with the higher score wins; its length adapts to how long the match is, up to
``num_speculative_tokens``. Deterministic, so the verifier treats the drafts as one-hot distributions; runs no
model, so it writes no K/V.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.spec_decode.config import SuffixSettings
from pagedllm.spec_decode.proposer import DraftJob, Proposals, Proposer
from pagedllm.spec_decode.suffix_index import SEPARATOR, SuffixIndex


class _Request:
    def __init__(self, num_prompt_tokens: int) -> None:
        self.index = SuffixIndex()
        self.num_prompt_tokens = num_prompt_tokens


class GlobalOutputs:
    """The outputs of the last ``max_requests`` finished requests in one index, each ended by SEPARATOR.

    An index only grows, so dropping the oldest outputs rebuilds it from the ones kept, once the kept ones hold
    half of it (each token is re-indexed a bounded number of times: amortised O(1))."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.outputs: OrderedDict[str, list[int]] = OrderedDict()
        self.index = SuffixIndex()
        self._live_tokens = 0

    def add(self, req_id: str, output: list[int]) -> None:
        if self.max_requests <= 0 or not output:
            return
        self.outputs[req_id] = output
        self.index.extend([*output, SEPARATOR])
        self._live_tokens += len(output) + 1
        while len(self.outputs) > self.max_requests:
            _, dropped = self.outputs.popitem(last=False)
            self._live_tokens -= len(dropped) + 1
        if self._live_tokens * 2 < len(self.index):
            self.index = SuffixIndex()
            for kept in self.outputs.values():
                self.index.extend([*kept, SEPARATOR])


class SuffixProposer(Proposer):
    """Drafts up to ``k`` tokens per request from its own suffix index and the global one."""

    def __init__(self, k: int, settings: SuffixSettings) -> None:
        self.k = k
        self.settings = settings
        self.requests: dict[str, _Request] = {}
        self.global_outputs = GlobalOutputs(settings.max_cached_requests)

    def _request(self, job: DraftJob) -> _Request:
        request = self.requests.get(job.req_id)
        if request is None or len(request.index) > len(job.token_ids):  # new (or rebuilt after a reset)
            request = self.requests[job.req_id] = _Request(job.num_prompt_tokens)
        if len(request.index) < len(job.token_ids):
            request.index.extend(job.token_ids[len(request.index):])
        return request

    def propose_one(self, job: DraftJob) -> list[int]:
        s = self.settings
        request = self._request(job)
        pattern = job.token_ids[-(s.max_tree_depth - 1):]
        args = (s.max_tree_depth, min(job.num_drafts, self.k), s.max_spec_factor, s.min_token_prob)
        own = request.index.draft(pattern, *args)
        shared = self.global_outputs.index.draft(pattern, *args)
        return (shared if shared.score > own.score else own).tokens

    def propose_batch(self, jobs: list[DraftJob]) -> Proposals:
        return Proposals({job.req_id: self.propose_one(job) for job in jobs if job.num_drafts > 0})

    def forget(self, req_id: str) -> None:
        """The request finished: its output joins the global index (its own index is dropped)."""
        request = self.requests.pop(req_id, None)
        if request is not None:
            output = request.index.tokens[request.num_prompt_tokens:].tolist()
            self.global_outputs.add(req_id, output)
