"""Parsers that find tool calls in a model's free text (``tool_choice: auto``), by model family.

Each parser turns the whole completion into (content, [(name, arguments JSON text)]), says where a tool
call may start (a stream holds content back from there), and locates the calls in a growing text
(``scan``) so a stream sends their arguments as they are generated. By default the server takes the parser
whose format the model's chat template asks for (``parser_for_template``); ``--tool-call-parser`` picks one
by name (vLLM's names).
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


# What a tool-aware chat template writes (or tells the model to write) -> the parser of its calls; the first
# match wins. Llama 3.x templates with tools ask for bare JSON calls; they are known by their header tokens,
# checked last because Hermes-style fine-tunes of Llama keep ChatML with <tool_call> blocks.
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"),
                     ("<|start_header_id|>", "llama3_json"))
DEFAULT_TOOL_PARSER = "hermes"


def parser_for_template(chat_template: object) -> str:
    """The parser for the tool calls a model's chat template produces.

    A template that knows nothing of tools (the default SmolLM2 is plain ChatML) is replaced, for requests
    with tools, by the built-in tool ChatML template, which asks for Hermes ``<tool_call>`` blocks. A
    tool-aware template with none of the known markers gets Hermes too, the most common format;
    ``--tool-call-parser`` overrides the choice."""
    if isinstance(chat_template, dict):  # named templates (transformers): the tool one renders tool requests
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if isinstance(chat_template, str) and "tools" in chat_template:
        for marker, name in _TEMPLATE_MARKERS:
            if marker in chat_template:
                return name
    return DEFAULT_TOOL_PARSER


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()
