"""The model runner's one handle on speculative decoding: verify this step's drafts, propose the next.

The runner hands over what it knows (its per-request states, the step's logits rows); this class owns
the proposer, the rows-per-position sampling metadata and the rejection rule.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedllm.host_to_device import index_rows, tensor_on
from pagedllm.logger import init_logger
from pagedllm.sample.batch_state import SamplingBatch
from pagedllm.sample.rejection_sampler import DraftRun, rejection_sample
from pagedllm.sample.sampler import Sampler, compute_logprobs_for_targets, logprob_dicts
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.draft_budget import DraftBudget
from pagedllm.spec_decode.governor import DraftGovernor
from pagedllm.spec_decode.model_drafter import ModelDrafter, make_draft_model_drafter, make_layer_skip_drafter
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.proposer import DraftJob, Proposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer

logger = init_logger(__name__)


def can_speculate(params: SamplingParams) -> bool:
    """Requests with structured outputs are not speculated (yet): their grammar would have to advance
    over the drafts and roll back on rejection."""
    return params.structured_outputs is None


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, target: Any, draft_model: Any | None, block_size: int,
                 device: torch.device) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.proposer: Proposer
        if config.method == "ngram":
            self.proposer = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(self.k, config.suffix)
        elif config.method == "layer_skip":
            self.proposer = make_layer_skip_drafter(target, config.num_draft_layers, block_size, device)
        else:
            self.proposer = make_draft_model_drafter(draft_model, block_size, device)
        # req_id -> [k, V] distributions its pending (random) drafts were drawn from.
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.governor = DraftGovernor(enabled=config.auto_disable)
        # Drafts per request from measured costs and acceptance (auto_disable: false drafts all it may).
        self.budget = DraftBudget() if config.auto_disable else None
        self.propose_seconds = 0.0  # wall seconds of the last ``propose``: not part of the verifier's cost
        # A drafting model runs on torch's intra-op threads, which the calling thread's CPU time leaves out.
        self._proposer_on_threads = isinstance(self.proposer, ModelDrafter)

    def forget(self, req_id: str) -> None:
        self.draft_probs.pop(req_id, None)
        self.proposer.forget(req_id)
        if self.budget is not None:
            self.budget.forget(req_id)

    # ---- verification ------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, jobs: list[tuple[Any, list[int], int]], sampling: SamplingBatch,
               sampler: Sampler) -> tuple[list[list[int]], list[list[dict[int, tuple[float, int]]] | None]]:
        """logits [N, V]: raw target logits; jobs: (runner state, drafts, first row) per request, each
        owning len(drafts) + 1 consecutive rows; ``sampling``: the runner's batch, which holds every job's
        request, and ``sampler`` the runner's, over the same stages (every stage but the draw applies to the
        target rows, as when sampling). Returns per job its new tokens and, if it asked for logprobs, one
        {token: (logprob, rank)} per new token (raw logprobs, like the Sampler's)."""
        req_ids, pending, row_ids = [], [], []
        for state, drafts, first_row in jobs:
            for i in range(len(drafts) + 1):
                req_ids.append(state.req_id)
                pending.append(drafts[:i])  # row i sees the drafts before it as output tokens
                row_ids.append(first_row + i)
        rows = index_rows(logits, row_ids)  # the identity in the runner: a view
        meta = sampling.metadata(req_ids, pending=pending)
        processed = sampler.process_logits(rows, meta)
        runs, first = [], 0
        for state, drafts, _ in jobs:
            probs = self.draft_probs.pop(state.req_id, None)
            runs.append(DraftRun(first, drafts, state.params.temperature < SAMPLING_EPS,
                                 probs[:len(drafts)] if probs is not None else None, state.generator))
            first += len(drafts) + 1
        tokens = rejection_sample(processed, runs)
        if self.budget is not None:
            for (state, drafts, _), new in zip(jobs, tokens):
                self.budget.record(state.req_id, len(drafts), len(new) - 1)
        return tokens, self._logprobs(rows, jobs, runs, tokens)

    def _logprobs(self, rows: torch.Tensor, jobs: list[tuple[Any, list[int], int]], runs: list[DraftRun],
                  tokens: list[list[int]]) -> list[list[dict[int, tuple[float, int]]] | None]:
        """Per job, if it asked for logprobs, one {token: (logprob, rank)} per new token: the raw logprobs of
        rows [N, V] (the Sampler's path), one gather per distinct number of top logprobs."""
        entries: list[list[dict[int, tuple[float, int]]] | None] = [None] * len(jobs)
        by_k: dict[int, list[int]] = {}
        for j, (state, _, _) in enumerate(jobs):
            if state.params.logprobs is not None:
                by_k.setdefault(state.params.logprobs, []).append(j)
        for k, members in by_k.items():
            picked = [runs[j].first_row + i for j in members for i in range(len(tokens[j]))]
            targets = tensor_on([t for j in members for t in tokens[j]], torch.long, self.device)
            dicts = logprob_dicts(compute_logprobs_for_targets(index_rows(rows, picked), targets, k),
                                  [k] * len(picked))
            at = 0
            for j in members:
                entries[j] = dicts[at:at + len(tokens[j])]
                at += len(tokens[j])
        return entries

    # ---- proposing ---------------------------------------------------------------------------------
    def _room(self, state: Any) -> int:
        """Drafts worth making for a request: none past max_tokens, and for a proposer that writes K/V none
        whose K/V would fall outside the request's blocks (its lookahead slots)."""
        room = self.k
        if state.params.max_tokens is not None:
            room = min(room, state.params.max_tokens - len(state.output_token_ids) - 1)
        if self.proposer.writes_kv:
            room = min(room, len(state.block_ids[0]) * self.block_size - len(state.token_ids) + 1)
        return max(room, 0)

    def _job(self, state: Any, start: int, query_len: int, sampled: bool, num: int) -> DraftJob | None:
        """The request's DraftJob this step (None: nothing to run or propose). ``start``/``query_len``: where
        its computed tokens began this step and how many were scheduled; ``num``: drafts it may get."""
        length = len(state.token_ids)
        if not self.proposer.writes_kv:
            if num == 0:
                return None
            begin = end = length  # a lookup runs no model
        elif self.proposer.catches_up_all:
            capacity = len(state.block_ids[0]) * self.block_size
            begin, end = start, min(length if sampled else start + query_len, capacity)
        else:
            begin, end = length - 1, length
        if end < length:
            num = 0  # its newest token has no slot yet: catch up now, propose next step
        if num == 0 and not self.proposer.catches_up_all:
            return None
        return DraftJob(state.req_id, state.token_ids, state.block_ids[0], begin, end, num,
                        state.params.temperature, state.generator, len(state.prompt_token_ids))

    def propose(self, states: list[Any], starts: list[int], query_lens: list[int], sampled: set[str]
                ) -> dict[str, list[int]]:
        """After the step: drafts for the requests that got new tokens (``sampled``).

        ``starts[i]``/``query_lens[i]``: where request i's computed tokens began this step and how many
        were scheduled (states already hold the accepted tokens)."""
        began = time.perf_counter()
        enabled = ((self.config.disable_by_batch_size is None or len(states) <= self.config.disable_by_batch_size)
                   and self.governor.drafting(len(states)))
        rooms = {state.req_id: self._room(state) for state in states
                 if enabled and state.req_id in sampled and can_speculate(state.params)}
        if self.budget is not None and rooms:
            rooms = self.budget.plan(rooms, len(states))
        jobs = []
        for state, start, q in zip(states, starts, query_lens):
            job = self._job(state, start, q, state.req_id in sampled, rooms.get(state.req_id, 0))
            if job is not None:
                jobs.append(job)
        if not jobs:
            self.propose_seconds = time.perf_counter() - began
            return {}
        # A host proposer's cost is its thread's CPU time (what other processes on the machine leave alone); a
        # drafting model's, its wall time.
        clock = time.perf_counter if self._proposer_on_threads else time.thread_time
        started = clock()
        proposals = self.proposer.propose_batch(jobs)
        if self.budget is not None:
            self.budget.observe_proposer(clock() - started, sum(job.num_drafts > 0 for job in jobs))
        self.draft_probs.update(proposals.probs)
        self.propose_seconds = time.perf_counter() - began
        return {rid: d for rid, d in proposals.drafts.items() if d}

    def observe_step(self, num_requests: int, num_tokens: int, seconds: float, verified: bool, rows: int) -> None:
        """A pure decode step (every request sampled, none computed prompt tokens) for the governor and the
        draft budget: ``seconds`` of model, verification and proposing (the budget's cost line leaves the
        proposing out); ``verified``: whether it checked drafts; ``rows``: its query tokens."""
        self.governor.observe(num_requests, num_tokens, seconds, verified)
        if self.budget is not None:
            self.budget.observe_step(num_requests, rows, verified, seconds - self.propose_seconds)
