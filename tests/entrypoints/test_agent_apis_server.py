"""The agent APIs on one real server: OpenAI's Responses API through the official ``openai`` client (the same
greedy text as the equivalent chat completion, streaming events in OpenAI's order, the store: retrieve, delete,
input_items and its bound, conversations and tool round trips through ``previous_response_id``, background runs
and cancel) and Anthropic's Messages API through the official ``anthropic`` client (text, streaming events, tools
and tool_choice, stop_sequences, count_tokens); bad input answered 4xx in each API's own error shape."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

# Starts a server on the default model. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

STORE_MAX = 6
QUESTION = "What is 2 + 2?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
LONG = {"type": "json_schema", "name": "long", "schema": {  # keeps the model busy for hundreds of tokens
    "type": "object", "properties": {"s": {"type": "string", "minLength": 5000}}, "required": ["s"]}}


@pytest.fixture(scope="module")
def agent_server(remote_server_cls):
    srv = remote_server_cls(["--served-model-name", "m", "--responses-store-max-entries", str(STORE_MAX)])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(agent_server):
    return agent_server.client()


def chat_text(client, messages, max_tokens=12, **kwargs):
    resp = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens,
                                          **kwargs)
    return resp


def test_greedy_text_equals_chat_completion(client) -> None:
    resp = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=12)
    chat = chat_text(client, [{"role": "user", "content": QUESTION}])
    assert resp.object == "response" and resp.model == "m" and resp.id.startswith("resp_")
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    want = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert resp.status == want


def test_instructions_and_message_items(client) -> None:
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    resp = client.responses.create(model="m", input=items, instructions="Be kind.", temperature=0,
                                   max_output_tokens=10, metadata={"k": "v"}, user="u1")
    chat = chat_text(client, [{"role": "system", "content": "Be kind."}, {"role": "system",
                     "content": "Answer in one word."}, {"role": "user", "content": QUESTION}], max_tokens=10)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.metadata == {"k": "v"} and resp.user == "u1" and resp.instructions == "Be kind."


def test_stream_events_in_order_and_deltas_join(client) -> None:
    full = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=12)
    events = list(client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=12,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if full.status == "completed" else "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == events[2].item.id
    # A streamed response is stored as it ended.
    assert client.responses.retrieve(final.id).output_text == text


def test_text_format_json_schema(client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    resp = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=30, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert resp.status == "completed" and isinstance(json.loads(resp.output_text)["answer"], int)
    assert resp.text.format.type == "json_schema"


def test_retrieve_input_items_delete(client) -> None:
    items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": QUESTION}]
    resp = client.responses.create(model="m", input=items, temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.status == resp.status
    listed = client.responses.input_items.list(resp.id, order="asc")
    assert [(i.role, i.content[0].text if isinstance(i.content, list) else i.content) for i in listed.data] == \
        [("user", "Hi"), ("assistant", "Hello!"), ("user", QUESTION)] or [i.role for i in listed.data] == \
        ["user", "assistant", "user"]
    newest_first = client.responses.input_items.list(resp.id, limit=2)
    assert [i.id for i in newest_first.data] == [i.id for i in listed.data][::-1][:2] and newest_first.has_more
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_previous_response_id_continues_the_conversation(client) -> None:
    first = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=8)
    second = client.responses.create(model="m", input="And 3 + 3?", previous_response_id=first.id, temperature=0,
                                     max_output_tokens=8)
    chat = chat_text(client, [{"role": "user", "content": QUESTION},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And 3 + 3?"}], max_tokens=8)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    # Only this request's own input is its input_items.
    assert [i.type for i in client.responses.input_items.list(second.id).data] == ["message"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_tool_round_trip_through_previous_response_id(client, tool_choice) -> None:
    first = client.responses.create(model="m", input="Weather in Oslo?", tools=[WEATHER], tool_choice=tool_choice,
                                    temperature=0, max_output_tokens=40)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 20 C"} for c in calls]
    second = client.responses.create(model="m", previous_response_id=first.id, input=outputs, tools=[WEATHER],
                                     temperature=0, max_output_tokens=10)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]}]
    messages += [{"role": "tool", "tool_call_id": c.call_id, "content": "Sunny, 20 C"} for c in calls]
    chat = chat_text(client, messages, max_tokens=10, tools=[CHAT_WEATHER])
    assert second.output_text == (chat.choices[0].message.content or "")
    assert [i.type for i in client.responses.input_items.list(second.id).data] == ["function_call_output"] * len(
        calls)


def test_streamed_function_call_events(client) -> None:
    kwargs = dict(model="m", input="Weather in Oslo?", tools=[WEATHER], temperature=0, max_output_tokens=40,
                  tool_choice={"type": "function", "name": "get_weather"})
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == full.output[0].arguments
    assert events[-1].response.output[0].call_id == added.item.call_id


def test_store_evicts_the_least_recently_used(client) -> None:
    ids = [client.responses.create(model="m", input=f"Count to {i}", temperature=0, max_output_tokens=1).id
           for i in range(STORE_MAX + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    unstored = client.responses.create(model="m", input="x", temperature=0, max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def _metric(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} metric")


def _kv_usage(server) -> float:
    return _metric(server, "vllm:kv_cache_usage_perc")


def test_background_runs_and_cancel_frees_blocks(client, agent_server) -> None:
    done = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=12, background=True)
    assert done.status in ("queued", "in_progress") and done.background
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    plain = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=12)
    assert got.output_text == plain.output_text

    long = client.responses.create(model="m", input="Write a long story.", temperature=0, max_output_tokens=1500,
                                   text={"format": LONG}, background=True)
    deadline = time.monotonic() + 60
    while _kv_usage(agent_server) == 0:  # running: it holds blocks
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while _kv_usage(agent_server) != 0:
        assert time.monotonic() < deadline, "a cancelled response kept its KV blocks"
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(plain.id)


def test_streamed_response_closed_by_its_client_frees_blocks(agent_server) -> None:
    body = {"model": "m", "input": "Write a long story.", "max_output_tokens": 1500, "text": {"format": LONG},
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{agent_server.url}/v1/responses",
                                                       json=body) as resp:
        lines = resp.iter_lines()
        assert any("response.output_text.delta" in next(lines) for _ in range(40))
        assert _kv_usage(agent_server) > 0
    # Aborted as the client leaves (ClosingStreamingResponse), long before the 1,500-token answer could end.
    deadline = time.monotonic() + 10
    while _kv_usage(agent_server) != 0:
        assert time.monotonic() < deadline, "a disconnected response kept its KV blocks"
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_client_gone_before_a_non_streamed_answer_aborts_it(agent_server, path) -> None:
    if path == "/v1/responses":
        body = {"model": "m", "input": "Write a long story.", "max_output_tokens": 1500, "text": {"format": LONG}}
    else:
        body = {"model": "m", "max_tokens": 1500, "messages": [{"role": "user", "content": "Write a long story."}],
                "output_config": {"format": {"type": "json_schema", "schema": LONG["schema"]}}}
    before = _metric(agent_server, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{agent_server.url}{path}", json=body, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 10
    while _kv_usage(agent_server) != 0:
        assert time.monotonic() < deadline, "the request ran on after its client left"
        time.sleep(0.05)
    assert _metric(agent_server, "vllm:generation_tokens_total") - before < 600


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, 400, "input"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}],
      "tool_choice": "required"}, 400, "structured_outputs"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text"),
    ({"input": "x", "background": True, "store": False}, 400, "background"),
    ({"input": "x", "thinking_token_budget": 3}, 400, "thinking_token_budget"),
    ({}, 400, "input"),
])
def test_bad_input_is_4xx_in_openai_shape(agent_server, body, status, param) -> None:
    resp = httpx.post(f"{agent_server.url}/v1/responses", json={"model": "m", "max_output_tokens": 4, **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] is None or error["param"].startswith(param.split(".")[0]), error
    assert param.split(".")[0] in error["message"] or error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_ids_are_404(agent_server) -> None:
    for method, path in [("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                         ("POST", "/v1/responses/resp_x/cancel"), ("GET", "/v1/responses/resp_x/input_items")]:
        resp = httpx.request(method, f"{agent_server.url}{path}")
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError", (method, path)


# ---- Anthropic's Messages API -----------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # this client sends no sampling fields of its own
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER["parameters"]}


@pytest.fixture(scope="module")
def anthropic_client(agent_server):
    import anthropic

    return anthropic.Anthropic(base_url=agent_server.url, api_key="EMPTY", max_retries=0, timeout=120)


def test_message_text_equals_chat_completion(anthropic_client, client) -> None:
    msg = anthropic_client.messages.create(model="m", max_tokens=12, extra_body=GREEDY, system="Be kind.",
                                           messages=[{"role": "user", "content": QUESTION}])
    chat = chat_text(client, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": QUESTION}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "m"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    counted = anthropic_client.messages.count_tokens(model="m", system="Be kind.",
                                                     messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == msg.usage.input_tokens


def test_message_stream_events_and_text(anthropic_client) -> None:
    kwargs = dict(model="m", max_tokens=12, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
    full = anthropic_client.messages.create(**kwargs)
    events = list(anthropic_client.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == full.content[0].text
    assert events[-2].delta.stop_reason == full.stop_reason and events[-2].usage.output_tokens == \
        full.usage.output_tokens
    with anthropic_client.messages.stream(**kwargs) as stream:  # the client's own helper accumulates the same
        assert stream.get_final_message().content[0].text == full.content[0].text


def test_stop_sequences(anthropic_client) -> None:
    base = anthropic_client.messages.create(model="m", max_tokens=12, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": QUESTION}])
    words = base.content[0].text.split()
    assert len(words) >= 2
    stop = words[1]
    msg = anthropic_client.messages.create(model="m", max_tokens=12, extra_body=GREEDY, stop_sequences=[stop],
                                           messages=[{"role": "user", "content": QUESTION}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert stop not in msg.content[0].text and base.content[0].text.startswith(msg.content[0].text)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_use_round_trip(anthropic_client, client, tool_choice) -> None:
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    msg = anthropic_client.messages.create(model="m", max_tokens=40, extra_body=GREEDY, tools=[ANTHROPIC_WEATHER],
                                           tool_choice=tool_choice, messages=ask)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input["city"], str)
    follow = ask + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny"}
                                                 for u in uses]}]
    answer = anthropic_client.messages.create(model="m", max_tokens=10, extra_body=GREEDY, tools=[ANTHROPIC_WEATHER],
                                              messages=follow)
    chat = chat_text(client, [ask[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
        for u in uses]}] + [{"role": "tool", "tool_call_id": u.id, "content": "Sunny"} for u in uses],
        max_tokens=10, tools=[CHAT_WEATHER])
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert text == (chat.choices[0].message.content or "")
    # Streamed, the tool input arrives as input_json_delta pieces that join to the same JSON.
    events = list(anthropic_client.messages.create(model="m", max_tokens=40, extra_body=GREEDY, stream=True,
                                                   tools=[ANTHROPIC_WEATHER], tool_choice=tool_choice,
                                                   messages=ask))
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta" and e.index == start.index)
    assert json.loads(partial) == uses[0].input
    assert events[-2].delta.stop_reason == "tool_use"


@pytest.mark.parametrize("body, status", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400),  # no max_tokens
    ({"max_tokens": 4, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]}, 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"},
      "tools": [ANTHROPIC_WEATHER]}, 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t"}]}, 400),
    ({"max_tokens": 4, "model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),  # not_found_error
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, 400),
])
def test_bad_messages_are_4xx_in_anthropic_shape(agent_server, body, status) -> None:
    resp = httpx.post(f"{agent_server.url}/v1/messages", json={"model": "m", **body})
    assert resp.status_code == status, resp.text
    data = resp.json()
    assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
    assert data["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_output_config_format_is_a_json_schema(anthropic_client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    msg = anthropic_client.messages.create(model="m", max_tokens=30, extra_body=GREEDY,
                                           output_config={"format": {"type": "json_schema", "schema": schema}},
                                           messages=[{"role": "user", "content": QUESTION}])
    assert msg.stop_reason == "end_turn" and isinstance(json.loads(msg.content[0].text)["answer"], int)


def test_anthropic_client_error_class(anthropic_client) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        anthropic_client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}])
