"""Reasoning parsers: split a reasoning model's output into its thinking and its answer (``--reasoning-parser``,
vLLM's names), whole or while it grows.

The ``<think>…</think>`` family:
- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output is reasoning from its first
  token (a leading ``<think>`` is skipped) until ``</think>``; output that never closes it is all reasoning.
- ``qwen3``: the output reasons only when it starts with ``<think>``; otherwise it is all answer.

``split`` is monotonic in the text: as the text grows, reasoning and content only grow at their ends, so a
stream sends the differences (``ReasoningStream``) and the deltas joined equal the finished split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import ReasoningParams


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    # True: reasoning from the first token (the prompt opened it); False: only after a leading start tag.
    opens_in_prompt = True

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning or None when the output has none, content). With ``final=False`` the text may still
        grow: what could be the start of a tag is held back from both."""
        body = text
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not final and self.start_tag.startswith(body):
            return ("" if self.opens_in_prompt else None), ""  # may still become the start tag
        elif not self.opens_in_prompt:
            return None, text
        end = body.find(self.end_tag)
        if end >= 0:
            return body[:end], body[end + len(self.end_tag):]
        hold = 0 if final else _partial_suffix(body, self.end_tag)
        return body[:len(body) - hold], ""

    def engine_params(self, tokenizer: Any, thinking_token_budget: int | None) -> ReasoningParams:
        """The token ids of the markers, for the engine's gate (grammar after thinking, budget)."""
        start = None if self.opens_in_prompt else tokenizer.encode(self.start_tag, add_special_tokens=False)
        return ReasoningParams(end_token_ids=tokenizer.encode(self.end_tag, add_special_tokens=False),
                               start_token_ids=start, thinking_token_budget=thinking_token_budget)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_prompt = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown parser {name!r} (known: {', '.join(sorted(REASONING_PARSERS))})")
    return REASONING_PARSERS[name]()


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's growing text -> the new reasoning and content since the last call."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta_text: str, final: bool) -> ReasoningDelta:
        self.text += delta_text
        reasoning, content = self.parser.split(self.text, final)
        reasoning = reasoning or ""
        out = ReasoningDelta(reasoning[self.sent_reasoning:], content[self.sent_content:])
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out
