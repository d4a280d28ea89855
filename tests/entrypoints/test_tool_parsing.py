"""Tool-call parsers, tool_choice planning and the built-in tool ChatML template, without a model."""

from __future__ import annotations

import json

import jinja2
import jsonschema
import pytest

from pagedllm.entrypoints.openai.structured import structured_outputs_from_request
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser, parser_for_template
from pagedllm.entrypoints.openai.tools import TOOL_CHATML_TEMPLATE, calls_from_constrained_output, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes_parser() -> None:
    parser = get_tool_parser("hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                     ("get_time", {})]
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse("<tool_call>{broken") == ("<tool_call>{broken", [])
    # Streaming holds back a partial marker, never content before it.
    assert parser.safe_prefix_len("Hello <tool") == len("Hello ")
    assert parser.safe_prefix_len("Hello") == len("Hello")
    assert parser.safe_prefix_len("ab<tool_call>{") == 2


def test_llama3_and_mistral_parsers() -> None:
    content, calls = get_tool_parser("llama3_json").parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[0].arguments) == {"x": 1}
    assert get_tool_parser("llama3_json").parse("Just text") == ("Just text", [])
    content, calls = get_tool_parser("mistral").parse('Sure [TOOL_CALLS][{"name": "a", "arguments": {"y": "z"}}]')
    assert content == "Sure" and calls[0].name == "a" and json.loads(calls[0].arguments) == {"y": "z"}
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}")


@pytest.mark.parametrize("template,parser", [
    (None, "hermes"),
    (CHATML, "hermes"),  # no tools in it: the built-in tool ChatML template (Hermes blocks) renders tool requests
    (TOOL_CHATML_TEMPLATE, "hermes"),
    ("{% if tools %}<|im_start|>system <tools>{{ tools }}</tools> answer in <tool_call></tool_call>{% endif %}",
     "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>system<|end_header_id|>{% if tools %}{{ tools }} Respond with "
     '{"name": function name, "parameters": ...}{% endif %}', "llama3_json"),
    ("{% if tools %}{{ tools }}{% endif %}{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% if tools %}{{ tools }} some format we do not know{% endif %}", "hermes"),
    ({"default": CHATML, "tool_use": "{% if tools %}{{ tools }}[TOOL_CALLS]{% endif %}"}, "mistral"),  # named
])
def test_auto_parser_follows_the_chat_template(template, parser) -> None:
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.serving_chat import ServingChat

    assert parser_for_template(template) == parser
    chat = object.__new__(ServingChat)
    chat.tokenizer = SimpleNamespace(chat_template=template)
    chat.configure_tools()  # the server's default: no --tool-call-parser
    assert chat.tool_parser.name == parser
    chat.configure_tools("mistral")  # --tool-call-parser chooses another
    assert chat.tool_parser.name == "mistral"


def test_plan_tools_modes_and_errors() -> None:
    assert plan_tools(None, None, None).mode == "none"
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.mode == "named" and named.constraint.json == WEATHER["function"]["parameters"]
    required = plan_tools([WEATHER], "required", False)
    assert required.constraint.json["maxItems"] == 1
    calls = calls_from_constrained_output(required, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    # 'auto' needs no server flag, and tools without tool_choice mean 'auto' (as in OpenAI's API).
    assert plan_tools([WEATHER], "auto", None).mode == "auto"
    assert plan_tools([WEATHER], None, None).mode == "auto"
    for tools, choice, field in [([WEATHER], {"type": "function", "function": {"name": "x"}}, "tool_choice"),
                                 ([WEATHER, WEATHER], "required", "tools.1.function.name"),
                                 ([{"type": "code"}], "required", "tools.0.type"),
                                 (None, "required", "tool_choice"), ([WEATHER], "always", "tool_choice")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            plan_tools(tools, choice, None)


def test_response_format_mapping() -> None:
    assert structured_outputs_from_request({"type": "text"}, None) is None
    assert structured_outputs_from_request({"type": "json_object"}, None).json_object
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True}}
    assert structured_outputs_from_request(fmt, None).json == {"type": "object"}
    assert structured_outputs_from_request(None, {"choice": ["a"]}).choice == ["a"]
    for fmt, so, field in [({"type": "json_schema"}, None, "response_format.json_schema"),
                           ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, None,
                            "response_format.json_schema.extra"),
                           ({"type": "yaml"}, None, "response_format.type"),
                           ({"type": "json_object"}, {"regex": "a"}, "structured_outputs"),
                           (None, {"regex": "a", "choice": ["b"]}, "structured_outputs")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            structured_outputs_from_request(fmt, so)


def test_tool_template_round_trips_calls_and_results() -> None:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
    ]
    text = env.from_string(TOOL_CHATML_TEMPLATE).render(messages=messages, tools=[WEATHER],
                                                        add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nrainy\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n") and text.count("Be brief.") == 1
    # What the model would answer parses back into the same call.
    content, calls = get_tool_parser("hermes").parse(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert content is None and calls[0].name == "get_weather"


def _feed(plan, pieces: list[str], finish: str = "stop"):
    from pagedllm.entrypoints.openai.chat_output import ChoiceStream
    from pagedllm.entrypoints.openai.chat_request import PreparedChat

    stream = ChoiceStream(PreparedChat([], None, plan, get_tool_parser("hermes"), None))
    content, deltas, reasons = "", [], []
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, finish if i == len(pieces) - 1 else None)
        content += delta.content
        deltas += delta.tool_calls
        reasons.append(delta.finish_reason)
    return content, deltas, reasons[-1]


def test_auto_streaming_holds_back_the_call_and_emits_deltas() -> None:
    plan = plan_tools([WEATHER], "auto", None)
    pieces = ["Sure", ", checking. <to", "ol_call>\n{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Oslo\"}}", "\n</tool_call>"]
    content, deltas, reason = _feed(plan, pieces)
    assert content == "Sure, checking. " and reason == "tool_calls"
    name = "".join(d["function"].get("name", "") for d in deltas)
    args = "".join(d["function"]["arguments"] for d in deltas)
    assert name == "get_weather" and json.loads(args) == {"city": "Oslo"}
    assert deltas[0]["id"].startswith("call_") and all(d["index"] == 0 for d in deltas)
    # No call: everything comes out as content, finish_reason unchanged.
    content, deltas, reason = _feed(plan, ["Hello <", "b>there"])
    assert content == "Hello <b>there" and deltas == [] and reason == "stop"


def test_named_streaming_cut_short_keeps_the_partial_call() -> None:
    # As OpenAI streams it: the arguments went out as they were generated; the finish reason says "length".
    plan = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    content, deltas, reason = _feed(plan, ['{"city": ', '"Os'], finish="length")
    assert content == "" and reason == "length"
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Os'
