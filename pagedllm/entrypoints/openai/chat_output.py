"""The way back from the engine: one choice's text → reasoning, answer content and tool calls, finished
(``finish_choice``) or while it streams (``ChoiceStream``). Chat completions, the Responses API and the
Messages API read their outputs through these and only shape them for their wire format.

Order of reading: the reasoning parser splits off the thinking first; tool calls and structured outputs
apply to the answer that follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.chat_request import PreparedChat
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream
from pagedllm.entrypoints.openai.tool_parsers import ParsedCall
from pagedllm.entrypoints.openai.tools import calls_from_constrained_output, new_call_id, tool_call_streamer


@dataclass
class OutputCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ChoiceResult:
    reasoning: str | None
    content: str | None
    calls: list[OutputCall]
    finish_reason: str | None  # "tool_calls" when calls were made


def _calls(prepared: PreparedChat, content: str, finish_reason: str | None) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished answer; no calls unless the output ended by itself."""
    plan = prepared.plan
    if plan.mode in ("named", "required"):
        if finish_reason != "stop":
            return content, []  # cut short (length/abort): the arguments are incomplete JSON
        return None, calls_from_constrained_output(plan, content)
    if plan.mode == "auto":
        return prepared.tool_parser.parse(content)
    return content, []


def finish_choice(prepared: PreparedChat, text: str, finish_reason: str | None) -> ChoiceResult:
    reasoning, content = None, text
    if prepared.reasoning_parser is not None:
        reasoning, content = prepared.reasoning_parser.split(text)
    answer, calls = _calls(prepared, content, finish_reason)
    if reasoning is not None and answer == "":
        answer = None  # all thinking, no answer yet
    out_calls = [OutputCall(new_call_id(), c.name, c.arguments) for c in calls]
    return ChoiceResult(reasoning, answer, out_calls, "tool_calls" if out_calls else finish_reason)


@dataclass
class ChoiceDelta:
    """What one output step adds to a choice. ``tool_calls`` are OpenAI chat tool-call deltas: a header
    ``{"index", "id", "type", "function": {"name", "arguments": ""}}`` then ``{"index", "function":
    {"arguments": piece}}``. ``finish_reason`` is set on the last delta ("tool_calls" when calls were made)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceStream:
    """One streamed choice: feed each output's new text; get the reasoning, content and tool-call deltas."""

    def __init__(self, prepared: PreparedChat) -> None:
        self.prepared = prepared
        self.reasoning = ReasoningStream(prepared.reasoning_parser) if prepared.reasoning_parser else None
        self.answer = ""  # the answer's text so far (after the reasoning)
        self.sent = 0  # characters of the answer sent as content
        self.streamer = tool_call_streamer(prepared.plan, prepared.tool_parser)

    def feed(self, text: str, finish_reason: str | None) -> ChoiceDelta:
        final = finish_reason is not None
        delta = ChoiceDelta()
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final)
            delta.reasoning, text = split.reasoning, split.content
        plan = self.prepared.plan
        if plan.mode == "none":
            delta.content, delta.finish_reason = text, finish_reason
            return delta
        self.answer += text
        full = self.answer
        delta.tool_calls = self.streamer.feed(full)
        if plan.mode != "auto":
            if not final:
                return delta
            if self.streamer.started:  # cut short (length): the partial call stays, as OpenAI streams it
                delta.finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                return delta
            delta.content, delta.finish_reason = full, finish_reason
            return delta
        parser = self.prepared.tool_parser
        if not final:
            safe = max(parser.safe_prefix_len(full), self.sent)
            delta.content, self.sent = full[self.sent:safe], safe
            return delta
        content, calls = _calls(self.prepared, full, finish_reason)
        if not calls and not self.streamer.started:
            delta.content, self.sent = full[self.sent:], len(full)
            delta.finish_reason = finish_reason
            return delta
        delta.content = (content or "")[self.sent:] if content else ""
        for i, call in enumerate(calls[len(self.streamer.sent):], start=len(self.streamer.sent)):
            delta.tool_calls.append({"index": i, "id": new_call_id(), "type": "function",
                                     "function": {"name": call.name, "arguments": ""}})
            delta.tool_calls.append({"index": i, "function": {"arguments": call.arguments}})
        delta.finish_reason = "tool_calls"
        return delta
