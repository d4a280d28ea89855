"""One request's reasoning phase, followed token by token: a grammar applies only once the thinking has ended,
and a thinking budget forces the end marker after N reasoning tokens.

States: ``opening`` (the output must first match the start marker's ids; a mismatch means no reasoning),
``thinking`` (tokens are reasoning until the end marker's ids appear), ``forcing`` (the budget is spent: the
end marker's ids are the only tokens allowed, one by one) and ``done`` (every later token is the answer).
Markers are matched on token ids: the models of the ``<think>`` family have them as single special tokens.
"""

from __future__ import annotations

from pagedllm.sampling_params import ReasoningParams


class ReasoningGate:
    def __init__(self, params: ReasoningParams) -> None:
        self.start = params.start_token_ids
        self.end = params.end_token_ids
        self.budget = params.thinking_token_budget
        self.state = "opening" if self.start else "thinking"
        self.num_reasoning_tokens = 0
        self._recent: list[int] = []  # opening: the ids seen so far; thinking: the last len(end) ids
        self._num_forced = 0
        self._check_budget()

    @property
    def done(self) -> bool:
        return self.state == "done"

    def forced_token(self) -> int | None:
        """The only token allowed next (the budget is spent, or a start marker is half written), or None."""
        if self.state == "forcing":
            return self.end[self._num_forced]
        if self.state == "opening" and self._recent:
            assert self.start is not None
            return self.start[len(self._recent)]
        return None

    def opening_token(self) -> int | None:
        """Before the first token: the start marker's first id, allowed besides whatever a grammar allows."""
        return self.start[0] if self.state == "opening" and not self._recent and self.start else None

    def accept(self, token: int) -> list[int]:
        """Take one output token; returns the tokens that belong to the answer (for the grammar), in order."""
        if self.state == "done":
            return [token]
        if self.state == "opening":
            assert self.start is not None
            self._recent.append(token)
            if self._recent != self.start[:len(self._recent)]:
                self.state = "done"  # no start marker: the whole output is the answer
                answer, self._recent = self._recent, []
                return answer
            if len(self._recent) == len(self.start):
                self.state, self._recent = "thinking", []
                self._check_budget()
            return []
        if self.state == "forcing":
            self._num_forced += 1
            if self._num_forced == len(self.end):
                self.state = "done"
            return []
        self.num_reasoning_tokens += 1
        self._recent = (self._recent + [token])[-len(self.end):]
        if self._recent == self.end:
            self.state = "done"
        else:
            self._check_budget()
        return []

    def _check_budget(self) -> None:
        if self.state == "thinking" and self.budget is not None and self.num_reasoning_tokens >= self.budget:
            # A partly written end marker is finished from where it stands.
            matched = next((k for k in range(len(self.end) - 1, 0, -1) if self._recent[-k:] == self.end[:k]), 0)
            self.state, self._num_forced = "forcing", matched
