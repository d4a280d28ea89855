"""Reasoning parsers on text: the split, the streamed split (deltas joined equal the split, whatever the
chunking), and tool calls / content read from the answer after the thinking."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.chat_output import ChoiceStream, finish_choice
from pagedllm.entrypoints.openai.chat_request import PreparedChat
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tools import plan_tools

CASES = {
    # text: (deepseek_r1 split, qwen3 split)
    "<think>I add.</think>\n\n4": (("I add.", "\n\n4"), ("I add.", "\n\n4")),
    "I add.</think>4": (("I add.", "4"), (None, "I add.</think>4")),
    "Still thinking <": (("Still thinking <", ""), (None, "Still thinking <")),
    "4": (("4", ""), (None, "4")),
    "<think></think>": (("", ""), ("", "")),
}


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("index, name", [(0, "deepseek_r1"), (1, "qwen3")])
def test_split(text: str, index: int, name: str) -> None:
    assert get_reasoning_parser(name).split(text) == CASES[text][index]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
def test_streamed_split_joins_to_the_split(name: str, step: int) -> None:
    parser = get_reasoning_parser(name)
    for text in CASES:
        stream = ReasoningStream(parser)
        reasoning = content = ""
        pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
        for i, piece in enumerate(pieces):
            delta = stream.feed(piece, final=i == len(pieces) - 1)
            # a tag is never sent in part: nothing sent so far contains '<' that later became a tag
            reasoning += delta.reasoning
            content += delta.content
        want_reasoning, want_content = parser.split(text)
        assert (reasoning, content) == (want_reasoning or "", want_content), (text, step)


def test_unknown_parser_names_the_field() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        get_reasoning_parser("nope")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def prepared(plan) -> PreparedChat:
    return PreparedChat([], None, plan, get_tool_parser("hermes"), get_reasoning_parser("deepseek_r1"))


def test_tool_calls_are_read_after_the_thinking() -> None:
    # A <tool_call> inside the thinking is reasoning, not a call.
    text = ('I could use <tool_call> here.</think>Let me check.<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>')
    plan = plan_tools([WEATHER], "auto", None)
    result = finish_choice(prepared(plan), text, "stop")
    assert result.reasoning == "I could use <tool_call> here."
    assert result.content == "Let me check." and result.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [("get_weather", {"city": "Oslo"})]
    stream = ChoiceStream(prepared(plan))
    reasoning = content = args = ""
    for i in range(0, len(text), 4):
        delta = stream.feed(text[i:i + 4], "stop" if i + 4 >= len(text) else None)
        reasoning += delta.reasoning
        content += delta.content
        args += "".join(d["function"]["arguments"] for d in delta.tool_calls)
    assert (reasoning, content, json.loads(args)) == (result.reasoning, result.content, {"city": "Oslo"})


def test_named_tool_choice_reads_the_answer_as_arguments() -> None:
    plan = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    result = finish_choice(prepared(plan), 'hmm</think>{"city": "Rome"}', "stop")
    assert result.reasoning == "hmm" and result.content is None
    assert result.calls[0].name == "get_weather" and json.loads(result.calls[0].arguments) == {"city": "Rome"}


def test_all_thinking_has_no_content() -> None:
    result = finish_choice(prepared(plan_tools(None, None, None)), "never ends", "length")
    assert result.reasoning == "never ends" and result.content is None and result.finish_reason == "length"
