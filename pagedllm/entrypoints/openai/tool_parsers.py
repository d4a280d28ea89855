"""Parsers that find tool calls in a model's free text (``tool_choice: auto``), by model family.

Each parser turns the whole completion into (content, [(name, arguments JSON text)]), says where a tool
call may start (a stream holds content back from there), and locates the calls in a growing text
(``scan``) so a stream sends their arguments as they are generated. ``--tool-call-parser`` picks one by
name (vLLM's names).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pagedllm.entrypoints.openai.json_scan import CallSpan, scan_array_of_calls, skip_space, span_of_object


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


class ToolParser:
    name = ""
    # Text that opens a tool call; a stream holds back text from its first occurrence (or a partial one).
    start_marker = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """Whole completion -> (content before the calls or None, calls). No calls: (text, [])."""
        raise NotImplementedError

    def safe_prefix_len(self, text: str) -> int:
        """How much of a growing ``text`` can be streamed as content: up to a (possible partial) marker."""
        start = self._marker_pos(text)
        if start is not None:
            return start
        for k in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def _marker_pos(self, text: str) -> int | None:
        pos = text.find(self.start_marker)
        return pos if pos >= 0 else None

    def scan(self, text: str) -> list[CallSpan]:
        """The calls visible so far in a growing completion (names and argument positions); [] = none yet."""
        return []


def _call_from_obj(obj: object, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen, our ChatML template)."""

    name = "hermes"
    start_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = self._marker_pos(text)
        if start is None:
            return text, []
        calls = []
        for body in self._block.findall(text[start:]):
            try:
                call = _call_from_obj(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []  # malformed: the text stays content, nothing is invented
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls

    def scan(self, text: str) -> list[CallSpan]:
        spans = []
        pos = text.find(self.start_marker)
        while pos >= 0:
            i = skip_space(text, pos + len(self.start_marker))
            if i >= len(text) or text[i] != "{":
                break
            span, end = span_of_object(text, i, "arguments")
            spans.append(span)
            if end is None:
                break
            pos = text.find(self.start_marker, end)
        return spans


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
    several separated by ``;``. The whole output must be calls (as Llama 3's template asks)."""

    name = "llama3_json"
    start_marker = "{"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from_obj(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def scan(self, text: str) -> list[CallSpan]:
        body_start = skip_space(text, 0)
        if text.startswith("<|python_tag|>", body_start):
            body_start = skip_space(text, body_start + len("<|python_tag|>"))
        spans, i = [], body_start
        while i < len(text) and text[i] == "{":
            span, end = span_of_object(text, i, "parameters", "arguments")
            spans.append(span)
            if end is None:
                break
            i = end
            while i < len(text) and text[i] in " \n\t;":
                i += 1
        return spans

    def safe_prefix_len(self, text: str) -> int:
        stripped = text.lstrip().removeprefix("<|python_tag|>").lstrip()
        return 0 if (not stripped or stripped.startswith("{") or "<|python_tag|>".startswith(text.strip())) \
            else len(text)


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

    name = "mistral"
    start_marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = self._marker_pos(text)
        if start is None:
            return text, []
        try:
            items = json.loads(text[start + len(self.start_marker):].strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call_from_obj(obj, "arguments") for obj in items]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:start].strip()
        return (content or None), calls  # type: ignore[return-value]

    def scan(self, text: str) -> list[CallSpan]:
        start = self._marker_pos(text)
        if start is None:
            return []
        i = skip_space(text, start + len(self.start_marker))
        if i < len(text) and text[i] == "[":
            return scan_array_of_calls(text, i, "arguments")
        return [span_of_object(text, i, "arguments")[0]] if i < len(text) and text[i] == "{" else []


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()
