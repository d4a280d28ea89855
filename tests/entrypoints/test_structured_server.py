"""Structured outputs and tool calling through the real server and the ``openai`` client: every completion
that ends by itself follows its constraint, tool calls validate, bad input is a 400 and the server keeps
serving."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from helpers.schemas import SCHEMAS

# Starts a server on the default model. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{2,9}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOL_SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(remote_server_cls):
    srv = remote_server_cls(["--served-model-name", "test-model", "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(tools_server):
    return tools_server.client()


async def _chat_many(server, n: int, **kwargs):
    async with server.async_client() as aclient:
        return await asyncio.gather(*[aclient.chat.completions.create(model="test-model", seed=i, **kwargs)
                                      for i in range(n)])


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_response_format_json_schema_validates(tools_server, name: str) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    outs = asyncio.run(_chat_many(tools_server, 4, messages=[{"role": "user", "content": "Answer in JSON."}],
                                  response_format=fmt, max_tokens=60, temperature=1.0))
    ended = [o.choices[0] for o in outs if o.choices[0].finish_reason == "stop"]
    assert ended
    for choice in ended:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_choice_regex_grammar_on_completions(client) -> None:
    out = client.completions.create(model="test-model", prompt="Pick one:", max_tokens=8, temperature=0.8,
                                    extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert out.choices[0].text in ("alpha", "beta", "gamma") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="test-model", prompt="A code:", max_tokens=12, temperature=0.8,
                                    extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.choices[0].text)
    out = client.chat.completions.create(model="test-model", messages=ASK, max_tokens=8, temperature=0,
                                         extra_body={"structured_outputs": {"grammar": 'root ::= "sun" | "rain"'}})
    assert out.choices[0].message.content in ("sun", "rain")
    out = client.chat.completions.create(model="test-model", messages=ASK, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_streamed_constrained_output_concatenates(client) -> None:
    kwargs = dict(model="test-model", messages=ASK, max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    # Greedy: the deltas concatenate to the non-streamed answer, whether or not it ended by itself.
    assert finish == whole.finish_reason and finish in ("stop", "length")
    assert text and text == whole.message.content
    if finish == "stop":
        jsonschema.validate(json.loads(text), SCHEMAS["person"])


def _check_calls(message, finish_reason: str) -> None:
    assert finish_reason == "tool_calls"
    assert message.tool_calls
    ids = [c.id for c in message.tool_calls]
    assert len(set(ids)) == len(ids)
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_named_and_required_tool_calls_validate(client, tool_choice) -> None:
    checked = 0
    for seed in range(3):
        out = client.chat.completions.create(model="test-model", messages=ASK, tools=[WEATHER, TIME],
                                             tool_choice=tool_choice, max_tokens=80, temperature=0.7, seed=seed)
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue
        _check_calls(choice.message, choice.finish_reason)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        checked += 1
    assert checked, "every seed ran out of tokens: no tool call was checked"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_call_deltas_concatenate(client, tool_choice) -> None:
    kwargs = dict(model="test-model", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
                  tool_choice=tool_choice)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
                call["pieces"] += bool(delta.function and delta.function.arguments)
    expected = whole.choices[0].message.tool_calls
    assert finish == "tool_calls" and len(calls) == len(expected)
    assert len({c["id"] for c in calls.values()}) == len(calls) and all(c["id"] for c in calls.values())
    for i, call in enumerate(expected):
        assert calls[i]["name"] == call.function.name
        assert calls[i]["arguments"] == call.function.arguments
        jsonschema.validate(json.loads(calls[i]["arguments"]), TOOL_SCHEMAS[call.function.name])
        if len(call.function.arguments) > 8:
            assert calls[i]["pieces"] > 1, "arguments stream as they are generated, not in one delta"


def test_auto_tool_choice_and_round_trip(client) -> None:
    out = client.chat.completions.create(model="test-model", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                         max_tokens=40, temperature=0)
    choice = out.choices[0]
    if choice.message.tool_calls:
        _check_calls(choice.message, choice.finish_reason)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    # A tool result goes back through the template (role tool, assistant with tool_calls).
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model="test-model", messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls


def test_tool_template_renders_tools_and_results(tools_server) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    body = {"model": "test-model", "messages": history, "tools": [WEATHER], "return_token_strs": True}
    r = httpx.post(f"{tools_server.url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json().get("token_strs"), r.json()
    text = "".join(r.json()["token_strs"])
    assert "get_weather" in text and "sunny" in text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "structured_outputs.json"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs.whitespace"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("extra,field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_structured_and_tool_fields_are_400(tools_server, extra, field) -> None:
    body = {"model": "test-model", "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and field.split(".")[0] in error["message"]


def test_bad_schema_does_not_hurt_other_requests(tools_server, client) -> None:
    async def run():
        async with tools_server.async_client() as aclient:
            good = aclient.chat.completions.create(
                model="test-model", messages=ASK, max_tokens=8, temperature=0,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
            bad = aclient.chat.completions.create(
                model="test-model", messages=ASK, max_tokens=8,
                extra_body={"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "x"}}}}})
            return await asyncio.gather(good, bad, return_exceptions=True)
    good, bad = asyncio.run(run())
    assert isinstance(bad, openai.BadRequestError) and "cannot be compiled" in str(bad)
    assert good.choices[0].message.content in ("yes", "no")
    assert client.completions.create(model="test-model", prompt="Hi", max_tokens=2).choices[0].text is not None
