"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's tail."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.spec_decode.proposer import DraftJob, Proposals, Proposer


class NgramProposer(Proposer):
    """Match the last n tokens (n from ``max_n`` down to ``min_n``) against everything before them
    (prompt + output so far); propose up to ``k`` tokens that followed the most recent match.

    Deterministic, so the verifier treats its drafts as one-hot distributions. Runs no model: writes no
    K/V and needs no catch-up.
    """

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """token_ids: the whole sequence so far; returns 0..k draft tokens."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = tokens[length - n:]
            # Windows starting at 0 .. length - n - 1 (the tail itself excluded).
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match: recent text predicts best
                return tokens[start:start + k].tolist()
        return []

    def propose_batch(self, jobs: list[DraftJob]) -> Proposals:
        """Each job's lookup over its whole sequence, up to its ``num_drafts`` tokens (no distributions)."""
        return Proposals({job.req_id: self.propose(job.token_ids, job.num_drafts) for job in jobs})
