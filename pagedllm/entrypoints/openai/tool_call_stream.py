"""Tool calls found in a growing completion, so their arguments stream as they are generated.

A scan reads the text generated so far and returns one ``CallSpan`` per call it can see: the function's
name once it is complete, and where the arguments' JSON text starts and (once closed) ends. The streamer
sends a header delta (id, name, empty arguments) when a call's name and the start of its arguments are
known, then every new piece of the arguments text as it arrives, like OpenAI's streaming tool calls: the
concatenated argument deltas of a call are exactly the text that ``final_calls`` returns for it.

Layouts: ``named`` (the whole output is the arguments object), ``required`` (a JSON array of
``{"name": ..., "parameters": {...}}``, as the grammar in ``tools.py`` asks), and the ``auto`` parsers'
formats (``ToolParser.scan``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.openai.json_scan import CallSpan, scan_array_of_calls, scan_object, skip_space
from pagedllm.entrypoints.openai.tool_parsers import ParsedCall


def scan_named(text: str) -> list[CallSpan]:
    """``tool_choice`` naming a function: the whole output is its arguments object (name given later)."""
    i = skip_space(text, 0)
    if i >= len(text):
        return []
    end = scan_object(text, i).end if text[i] == "{" else None
    return [CallSpan(None, i, end)]


def scan_required(text: str) -> list[CallSpan]:
    """``tool_choice: required``: a JSON array of ``{"name": ..., "parameters": {...}}``."""
    i = skip_space(text, 0)
    return scan_array_of_calls(text, i, "parameters") if i < len(text) and text[i] == "[" else []


def final_calls(spans: list[CallSpan], text: str, named: str | None = None) -> list[ParsedCall]:
    """The complete calls of a finished output, arguments as the exact text generated (what was streamed)."""
    calls = []
    for span in spans:
        name = named if named is not None else span.name
        if name is None or span.args_start is None or span.args_end is None:
            raise ValueError("tool call is incomplete")
        arguments = text[span.args_start:span.args_end]
        if not isinstance(json.loads(arguments), dict):
            raise ValueError("tool call arguments are not a JSON object")
        calls.append(ParsedCall(name, arguments))
    return calls


class ToolCallStreamer:
    """Turns one choice's growing text into OpenAI tool-call deltas.

    ``scan`` maps the text so far to its call spans; ``named`` is the function of a named tool choice.
    A call's arguments that are a JSON *string* (some models write ``"arguments": "{...}"``) are sent
    decoded, in one piece, once the string is complete.
    """

    def __init__(self, scan: Callable[[str], list[CallSpan]], new_id: Callable[[], str],
                 named: str | None = None) -> None:
        self.scan, self.new_id, self.named = scan, new_id, named
        self.sent: list[int] = []  # per call: characters of its arguments text already sent

    @property
    def started(self) -> bool:
        return bool(self.sent)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """All of the choice's text so far -> the deltas not sent yet."""
        deltas: list[dict[str, Any]] = []
        for index, span in enumerate(self.scan(text)):
            name = self.named if self.named is not None else span.name
            if name is None or span.args_start is None:
                break  # later calls cannot start before this one has
            if index == len(self.sent):
                deltas.append({"index": index, "id": self.new_id(), "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self.sent.append(0)
            piece = self._arguments(text, span)
            if piece is not None and len(piece) > self.sent[index]:
                deltas.append({"index": index, "function": {"arguments": piece[self.sent[index]:]}})
                self.sent[index] = len(piece)
        return deltas

    @staticmethod
    def _arguments(text: str, span: CallSpan) -> str | None:
        assert span.args_start is not None
        if text[span.args_start] == '"':  # arguments given as a JSON string: send it decoded when closed
            if span.args_end is None:
                return None
            try:
                value = json.loads(text[span.args_start:span.args_end])
            except ValueError:
                return None
            return value if isinstance(value, str) else None
        return text[span.args_start:span.args_end if span.args_end is not None else len(text)]
