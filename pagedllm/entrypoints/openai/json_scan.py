"""Where tool calls sit in a growing, possibly unfinished JSON text: a tolerant scanner (strings, escapes,
nesting) that finds an object's top-level keys and an array's call objects, with character positions, so
a stream can send a call's arguments while they are still being generated. The final parse still checks
full JSON validity; this only locates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class CallSpan:
    name: str | None  # None until the name's string is complete
    args_start: int | None  # index of the arguments' first character; None until it is generated
    args_end: int | None = None  # one past the arguments' last character; None while still open


@dataclass
class ObjectScan:
    """Top-level keys of one JSON object: key -> (value start, value end or None while open)."""

    values: dict[str, tuple[int, int | None]]
    end: int | None  # one past the closing brace; None while open


def scan_object(text: str, start: int) -> ObjectScan:
    """Scan the (possibly unfinished) JSON object that opens at ``text[start] == "{"``.

    Tolerant: it tracks strings, escapes and nesting, not full JSON validity (the final parse checks that).
    """
    values: dict[str, tuple[int, int | None]] = {}
    depth, in_string, escaped = 0, False, False
    state, key, string_start, value_start = "key", "", 0, 0
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and state == "key_string":
                    try:
                        key = json.loads(text[string_start:i + 1])
                    except ValueError:
                        key = text[string_start + 1:i]
                    state = "colon"
                elif depth == 1 and state == "string_value":
                    values[key] = (value_start, i + 1)
                    state = "after"
            continue
        if c in " \t\r\n":
            continue
        if c == '"':
            in_string, string_start = True, i
            if depth == 1 and state == "key":
                state = "key_string"
            elif depth == 1 and state == "value":
                state, value_start = "string_value", i
                values[key] = (i, None)
            continue
        if c in "{[":
            depth += 1
            if depth == 2 and state == "value":
                state, value_start = "nested_value", i
                values[key] = (i, None)
            continue
        if c in "}]":
            depth -= 1
            if depth == 1 and state == "nested_value":
                values[key] = (value_start, i + 1)
                state = "after"
            elif depth == 0:
                if state == "scalar_value":
                    values[key] = (value_start, _rstrip_end(text, value_start, i))
                return ObjectScan(values, i + 1)
            continue
        if depth != 1:
            continue
        if c == ":" and state == "colon":
            state = "value"
        elif c == ",":
            if state == "scalar_value":
                values[key] = (value_start, _rstrip_end(text, value_start, i))
            state = "key"
        elif state == "value":
            state, value_start = "scalar_value", i
            values[key] = (i, None)
    return ObjectScan(values, None)


def _rstrip_end(text: str, start: int, end: int) -> int:
    while end > start and text[end - 1] in " \t\r\n":
        end -= 1
    return end


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def span_of_object(text: str, start: int, args_key: str,
                   fallback_key: str | None = None) -> tuple[CallSpan, int | None]:
    """The call in the object opening at ``start`` (``{"name": ..., args_key: {...}}``) and the object's end."""
    obj = scan_object(text, start)
    name = None
    if "name" in obj.values and obj.values["name"][1] is not None:
        a, b = obj.values["name"]
        try:
            value = json.loads(text[a:b])
            name = value if isinstance(value, str) else None
        except ValueError:
            name = None
    where = obj.values.get(args_key)
    if where is None and fallback_key is not None:
        where = obj.values.get(fallback_key)
    if where is None:
        return CallSpan(name, None), obj.end
    return CallSpan(name, where[0], where[1]), obj.end


def scan_array_of_calls(text: str, start: int, args_key: str, fallback_key: str | None = None) -> list[CallSpan]:
    """Calls in the (possibly unfinished) JSON array opening at ``text[start] == "["``."""
    spans = []
    i = skip_space(text, start + 1)
    while i < len(text) and text[i] == "{":
        span, end = span_of_object(text, i, args_key, fallback_key)
        spans.append(span)
        if end is None:
            break
        i = skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_space(text, i + 1)
    return spans
