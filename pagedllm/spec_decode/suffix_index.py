"""``SuffixIndex``: the suffix tree of a token sequence, walked through the occurrences of each token.

Suffix decoding (Arctic Inference, arXiv 2411.04975) drafts from a suffix tree: it finds the sequence's newest
tokens (the pattern) as a path from the root, then follows the most frequent children, each child's frequency over
its parent's being the probability that the continuation is right. A node of that tree at depth m stands for every
place a run of m tokens occurs, and its count is their number, so the tree is implicit in the occurrence lists:
this index keeps, per token, the positions it occurs at (appending a token is O(1)), narrows them to the pattern one
token at a time (each step filters a shrinking array), and walks the children by counting the tokens that follow
the remaining occurrences. The drafts equal those of an explicit depth-bounded suffix tree, without its nodes
(which cost tens of bytes per token and depth in Python).

``SEPARATOR`` ends one sequence where several share an index (the global index over finished outputs): no match
and no continuation crosses it. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEPARATOR = -1


@dataclass
class Draft:
    """A walk's tokens and its score: the sum of each token's path probability (the expected accepted tokens)."""

    tokens: list[int]
    score: float


class SuffixIndex:
    """Positions of every token of a growing sequence (``extend``), and drafts after a pattern (``draft``)."""

    def __init__(self) -> None:
        self._tokens = np.empty(256, dtype=np.int64)
        self._length = 0
        self._positions: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self._length

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[:self._length]

    def extend(self, tokens: list[int] | np.ndarray) -> None:
        """Append ``tokens`` (SEPARATOR allowed) to the sequence."""
        tokens = np.asarray(tokens, dtype=np.int64)
        need = self._length + len(tokens)
        if need > len(self._tokens):
            grown = np.empty(max(need, 2 * len(self._tokens)), dtype=np.int64)
            grown[:self._length] = self._tokens[:self._length]
            self._tokens = grown
        self._tokens[self._length:need] = tokens
        for offset, token in enumerate(tokens.tolist()):
            if token != SEPARATOR:
                self._positions.setdefault(token, []).append(self._length + offset)
        self._length = need

    def draft(self, pattern: list[int], max_depth: int, max_tokens: int, max_spec_factor: float,
              min_token_prob: float) -> Draft:
        """The best draft after any suffix of ``pattern`` (its last 1..``max_depth`` - 1 tokens) that occurs in the
        sequence with something after it.

        For a match of m tokens the walk drafts at most min(``max_tokens``, ``max_spec_factor`` x m, ``max_depth`` -
        m) tokens (a depth-bounded tree: the pattern and its continuation fit in ``max_depth``), each the most
        frequent next token of the occurrences still on the path, and stops where the path's probability falls
        under ``min_token_prob``. Of the matches, the draft with the highest score wins (longer matches are
        surer, shorter ones reach further). The sequence's own end, when the pattern is it, has nothing after it
        and so never matches itself.
        """
        end = self._length
        best, best_m = Draft([], 0.0), 0
        if not pattern or end == 0:
            return best
        first = self._positions.get(pattern[-1])
        if not first:
            return best
        ends = np.asarray(first, dtype=np.int64)  # positions where the last m tokens of the pattern end
        ends = ends[ends < end - 1]  # something must follow (this also drops the sequence's own end)
        tokens = self.tokens
        longest = min(len(pattern), max_depth - 1)
        matches: list[tuple[int, int, np.ndarray]] = []  # (draft limit, m, occurrences' ends)
        m = 1
        while m <= longest:
            if m > 1:
                starts = ends - (m - 1)
                ends = ends[(starts >= 0) & (tokens[np.maximum(starts, 0)] == pattern[-m])]
            if ends.size == 0:
                break
            if ends.size == 1:  # one occurrence left: how far back it matches, in one comparison
                e = int(ends[0])
                span = min(longest, e + 1)
                back = tokens[e + 1 - span:e + 1][::-1] != np.asarray(pattern[len(pattern) - span:][::-1])
                mismatch = np.flatnonzero(back)
                upto = int(mismatch[0]) if mismatch.size else span
                matches += [(self._limit(n, max_tokens, max_spec_factor, max_depth), n, ends)
                            for n in range(m, upto + 1)]
                break
            matches.append((self._limit(m, max_tokens, max_spec_factor, max_depth), m, ends))
            m += 1
        # A walk's score is at most its limit (each probability is at most 1): walk the longest limits first and
        # skip a match that cannot beat the best so far (on a tie the shorter match wins, as walking in order of m).
        for limit, m, ends in sorted(matches, key=lambda x: (-x[0], x[1])):
            if limit < best.score or (limit == best.score and m > best_m):
                continue
            found = self._walk(ends, limit, min_token_prob)
            if found.score > best.score or (found.score == best.score and m < best_m):
                best, best_m = found, m
        return best

    @staticmethod
    def _limit(m: int, max_tokens: int, max_spec_factor: float, max_depth: int) -> int:
        """Drafts a match of m tokens may make: the factor's share, within the tree's depth."""
        return min(max_tokens, int(max_spec_factor * m), max_depth - m)

    def _walk(self, ends: np.ndarray, limit: int, min_token_prob: float) -> Draft:
        """Follow the most frequent continuation of the occurrences ending at ``ends`` for up to ``limit`` tokens."""
        tokens, end = self.tokens, self._length
        drafted: list[int] = []
        prob, score = 1.0, 0.0
        for depth in range(1, limit + 1):
            if ends.size == 1:  # one occurrence left: its next tokens, each as likely as the path so far
                run = tokens[ends[0] + depth:min(ends[0] + limit + 1, end)].tolist()
                if SEPARATOR in run:
                    run = run[:run.index(SEPARATOR)]
                drafted += run
                score += prob * len(run)
                break
            at = ends + depth
            ends = ends[at < end]
            if ends.size == 0:
                break
            following = tokens[ends + depth]
            following_ok = following != SEPARATOR
            if not following_ok.any():
                break
            values, counts = np.unique(following[following_ok], return_counts=True)
            choice = int(np.argmax(counts))
            prob *= counts[choice] / following.size
            if prob < min_token_prob:
                break
            token = int(values[choice])
            drafted.append(token)
            score += prob
            ends = ends[following == token]
        return Draft(drafted, score)
