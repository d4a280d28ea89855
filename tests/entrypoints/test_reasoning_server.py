"""Reasoning output on a real server (``--reasoning-parser deepseek_r1``) through the ``openai`` client: the
thinking comes back as ``reasoning`` / ``reasoning_content`` apart from ``content``, streamed as separate
deltas; ``thinking_token_budget`` ends it after N tokens; a JSON schema holds for the answer after it.

The default model is no reasoning model: the budget is what makes it write ``</think>``, which is exactly the
engine path a real model's own end marker takes."""

from __future__ import annotations

import json

import pytest

# Starts a server on the default model. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name a colour."}]
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
          "required": ["colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def reasoning_server(remote_server_cls):
    srv = remote_server_cls(["--served-model-name", "m", "--reasoning-parser", "deepseek_r1"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(reasoning_server):
    return reasoning_server.client()


def free_text(client, max_tokens: int) -> str:
    """The model's own first tokens for MESSAGES, through /v1/completions (no reasoning parser there)."""
    ids = client.post("/../tokenize", body={"messages": MESSAGES}, cast_to=object)["tokens"]
    return client.completions.create(model="m", prompt=ids, max_tokens=max_tokens, temperature=0).choices[0].text


def test_budget_splits_thinking_from_answer(client) -> None:
    resp = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=14,
                                          extra_body={"thinking_token_budget": 4})
    message = resp.choices[0].message
    extra = message.model_extra
    assert extra["reasoning"] == free_text(client, 4)
    assert extra["reasoning_content"] == extra["reasoning"]
    assert message.content and "</think>" not in message.content
    assert resp.usage.completion_tokens <= 14


def test_streamed_deltas_join_to_the_split(client) -> None:
    kwargs = dict(model="m", messages=MESSAGES, temperature=0, max_tokens=14, extra_body={"thinking_token_budget": 4})
    full = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = content = ""
    kinds = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning"):
            assert extra["reasoning_content"] == extra["reasoning"] and not delta.content
            reasoning += extra["reasoning"]
            kinds.append("reasoning")
        if delta.content:
            content += delta.content
            kinds.append("content")
    assert reasoning == full.model_extra["reasoning"] and content == full.content
    assert kinds.index("content") > kinds.index("reasoning") and "reasoning" not in kinds[kinds.index("content"):]


def test_schema_holds_for_the_answer_after_the_thinking(client) -> None:
    resp = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=40, extra_body={"thinking_token_budget": 3},
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    message = resp.choices[0].message
    assert message.model_extra["reasoning"] == free_text(client, 3)  # the thinking itself is unconstrained
    assert resp.choices[0].finish_reason == "stop"
    assert set(json.loads(message.content)) == {"colour"}


def test_unfinished_thinking_is_all_reasoning(client) -> None:
    resp = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=5)
    message = resp.choices[0].message
    assert message.content is None and message.model_extra["reasoning"] == free_text(client, 5)
    assert resp.choices[0].finish_reason == "length"


def test_bad_budget_is_400(client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5,
                                       extra_body={"thinking_token_budget": -2})


def test_responses_reasoning_item_and_events(client) -> None:
    kwargs = dict(model="m", input=MESSAGES[0]["content"], temperature=0, max_output_tokens=14,
                  extra_body={"thinking_token_budget": 4})
    resp = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=14,
                                          extra_body={"thinking_token_budget": 4}).choices[0].message
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == chat.model_extra["reasoning"] and resp.output_text == chat.content
    assert resp.usage.output_tokens_details.reasoning_tokens >= 4
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    last_reasoning = max(i for i, k in enumerate(kinds) if k == "response.reasoning_text.delta")
    assert last_reasoning < kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        chat.model_extra["reasoning"]
    assert events[-1].response.output_text == chat.content


def test_messages_thinking_block(reasoning_server, client) -> None:
    import anthropic

    ac = anthropic.Anthropic(base_url=reasoning_server.url, api_key="EMPTY", max_retries=0)
    chat = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=14,
                                          extra_body={"thinking_token_budget": 4}).choices[0].message
    kwargs = dict(model="m", max_tokens=14, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 4},
                  extra_body={"temperature": 0})
    msg = ac.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == chat.model_extra["reasoning"] and msg.content[1].text == chat.content
    events = list(ac.messages.create(stream=True, **kwargs))
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert thinking == msg.content[0].thinking
