"""Cumulative speculative-decoding counters, kept by the scheduler and read by the metrics room."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counts since start-up. A *draft* is one request's run of draft tokens verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # The draft governor's decisions: "<batch-size bucket>:<on|off>" -> times (spec_decode/governor.py).
    governor_decisions: dict[str, int] = field(default_factory=dict)
    # accepted_per_pos[i]: drafts whose token at position i (0-based) was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def num_auto_disabled(self) -> int:
        """Times the governor turned drafting off, at any batch size."""
        return sum(n for key, n in self.governor_decisions.items() if key.endswith(":off"))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step per request: accepted drafts plus the one token every step yields."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
