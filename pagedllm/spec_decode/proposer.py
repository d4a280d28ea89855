"""What every way of drafting implements (n-gram lookup, a draft model, the target's first layers): the
step's ``DraftJob`` list in, ``Proposals`` out, read by ``SpecDecoder`` alone."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class DraftJob:
    """One request's drafting work this step: run positions [start, end) of ``token_ids`` through a model
    proposer (its catch-up; an n-gram lookup runs nothing and gets start == end), then propose
    ``num_drafts`` tokens after the sequence (0: catch-up only)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    num_drafts: int
    temperature: float
    generator: torch.Generator | None
    num_prompt_tokens: int = 0  # the first tokens of ``token_ids`` that are the prompt


@dataclass
class Proposals:
    """``drafts``: per proposing request its draft tokens (possibly none). ``probs``: for requests whose
    drafts were sampled (a model proposer at temperature > 0), [k, V] float32, row i the distribution
    draft i was drawn from; requests without an entry count as deterministic (one-hot) drafts."""

    drafts: dict[str, list[int]] = field(default_factory=dict)
    probs: dict[str, torch.Tensor] = field(default_factory=dict)


class Proposer(ABC):
    """Drafts tokens for the target model to verify."""

    #: The proposer writes K/V for its own proposals (a model does): drafts must fit the lookahead slots the
    #: scheduler reserved in the request's blocks, and the newest token needs a slot before proposing.
    writes_kv: bool = False
    #: Every token the target computed is also run through the proposer (a separate draft model keeps its own
    #: KV cache in step with the target's), not only the newest one.
    catches_up_all: bool = False

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted: drop what is kept for it (a proposer that learns from
        finished outputs takes them here)."""
        return None

    @abstractmethod
    def propose_batch(self, jobs: list[DraftJob]) -> Proposals:
        """The step's jobs (each request at most once) -> their drafts. No job asks for more than
        ``num_drafts`` tokens; a proposer may return fewer."""
