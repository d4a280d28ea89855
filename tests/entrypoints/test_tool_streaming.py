"""Incremental tool-call streaming without a model: the scanner finds calls in unfinished JSON, and the
streamer's argument deltas, however the text is chunked, concatenate to exactly the final call."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pagedllm.entrypoints.openai.json_scan import scan_object
from pagedllm.entrypoints.openai.tool_call_stream import ToolCallStreamer, final_calls, scan_named, scan_required
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tools import calls_from_constrained_output, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

TRICKY_ARGS = '{"city": "Os}lo \\"{[", "days": [1, {"a": []}], "ok": true, "n": -1.5e3}'


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(scan, text: str, cuts: list[int], named: str | None = None) -> dict[int, dict]:
    """Feed ``text`` growing at ``cuts``; returns index -> {id, name, arguments, pieces}."""
    streamer = ToolCallStreamer(scan, _ids(), named=named)
    calls: dict[int, dict] = {}
    for end in cuts + [len(text)]:
        for delta in streamer.feed(text[:end]):
            call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": "", "pieces": 0})
            if "id" in delta:
                assert call["id"] is None, "the header is sent once"
                call["id"], call["name"] = delta["id"], delta["function"]["name"]
                assert delta["function"]["arguments"] == ""
            else:
                assert call["id"] is not None, "arguments never come before their call's header"
                call["arguments"] += delta["function"]["arguments"]
                call["pieces"] += 1
    return calls


def random_cuts(text: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))


def test_scan_object_finds_keys_in_finished_and_unfinished_text() -> None:
    text = '{"name": "f", "arguments": ' + TRICKY_ARGS + ', "x": 3 }'
    scan = scan_object(text, 0)
    assert scan.end == len(text)
    a, b = scan.values["arguments"]
    assert text[a:b] == TRICKY_ARGS
    assert text[slice(*scan.values["x"])] == "3"
    cut = text[:text.index("days")]
    partial = scan_object(cut, 0)
    assert partial.end is None and partial.values["arguments"] == (a, None)


@pytest.mark.parametrize("seed", range(8))
def test_named_arguments_stream_in_pieces_and_equal_the_final_call(seed: int) -> None:
    plan = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    cuts = [1, 5, 9] if seed == 0 else random_cuts(TRICKY_ARGS, seed)
    calls = stream(scan_named, TRICKY_ARGS, cuts, named="get_weather")
    final = calls_from_constrained_output(plan, TRICKY_ARGS)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == final[0].arguments == TRICKY_ARGS
    if seed == 0:
        assert calls[0]["pieces"] == 4  # incremental, not one delta at the end


@pytest.mark.parametrize("seed", range(8))
def test_required_calls_stream_each_in_order(seed: int) -> None:
    plan = plan_tools([WEATHER, TIME], "required", None)
    text = '[{"name": "get_weather", "parameters": ' + TRICKY_ARGS + '}, {"name": "get_time", "parameters": {}}]'
    calls = stream(scan_required, text, random_cuts(text, seed))
    final = calls_from_constrained_output(plan, text)
    assert [c.name for c in final] == ["get_weather", "get_time"]
    assert [calls[i]["name"] for i in (0, 1)] == ["get_weather", "get_time"]
    assert [calls[i]["arguments"] for i in (0, 1)] == [c.arguments for c in final] == [TRICKY_ARGS, "{}"]
    assert calls[0]["id"] != calls[1]["id"]


def test_a_call_waits_for_its_name() -> None:
    streamer = ToolCallStreamer(scan_required, _ids())
    assert streamer.feed('[{"name": "get_wea') == []
    deltas = streamer.feed('[{"name": "get_weather", "parameters": {"ci')
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[1]["function"]["arguments"] == '{"ci'


@pytest.mark.parametrize("parser,text,args", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + TRICKY_ARGS +
     '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', [TRICKY_ARGS, "{}"]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + TRICKY_ARGS +
     '}; {"name": "get_time", "parameters": {}}', [TRICKY_ARGS, "{}"]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + TRICKY_ARGS +
     '}, {"name": "get_time", "arguments": {}}]', [TRICKY_ARGS, "{}"]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
     ['{"city": "Oslo"}']),  # arguments as a JSON string: sent decoded, once complete
])
def test_auto_parsers_stream_calls_the_final_parse_agrees_with(parser: str, text: str, args: list[str]) -> None:
    tool_parser = get_tool_parser(parser)
    for seed in range(5):
        calls = stream(tool_parser.scan, text, random_cuts(text, seed))
        _, parsed = tool_parser.parse(text)
        assert [calls[i]["name"] for i in range(len(parsed))] == [c.name for c in parsed]
        assert [calls[i]["arguments"] for i in range(len(parsed))] == args
        assert [json.loads(a) for a in args] == [json.loads(c.arguments) for c in parsed]


def test_final_calls_refuses_incomplete_calls() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Os'
    with pytest.raises(ValueError):
        final_calls(scan_required(text), text)
