"""Bad input gives OpenAI-shaped 4xx errors (never a 500) and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

# Starts a server on the default model. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

GOOD = {"model": "test-model", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

BAD_COMPLETIONS = [
    ({"max_tokens": "lots"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
]


def _assert_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param or param in err["message"], err
    return err


@pytest.mark.parametrize(("patch", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_params(server, patch, param):
    _assert_error(httpx.post(f"{server.url}/v1/completions", json={**GOOD, **patch}), 400, param)


def test_unknown_model_is_a_404_naming_it(server):
    # vLLM's status for a model it does not serve (an adapter name not loaded included: docs/lora.md)
    err = _assert_error(httpx.post(f"{server.url}/v1/completions", json={**GOOD, "model": "no-such-model"}), 404,
                        "model")
    assert err["type"] == "NotFoundError" and "no-such-model" in err["message"]


@pytest.mark.parametrize("patch", [{"messages": []}, {"messages": [{"content": "no role"}]},
                                   {"messages": "hi"}, {"max_completion_tokens": -3},
                                   {"top_logprobs": 3}, {"temperature": "hot"}])
def test_bad_chat_params(server, patch):
    _assert_error(httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, **patch}), 400)


def test_invalid_json_and_wrong_body(server):
    for body in (b"{not json", b"[1, 2]", b"", b'"just a string"'):
        r = httpx.post(f"{server.url}/v1/completions", content=body,
                       headers={"content-type": "application/json"})
        _assert_error(r, 400)


def test_too_long_prompt_says_the_numbers(server, client):
    long_prompt = "hello " * 2100  # > 2048 tokens at --max-model-len 2048
    err = _assert_error(httpx.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": long_prompt}), 400)
    assert "maximum context length is 2048 tokens" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="test-model", max_tokens=2000,
                                       messages=[{"role": "user", "content": "hi " * 100}])
    message = info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)
    assert "2048" in message and "in the messages" in message and "2000 in the completion" in message


def test_unknown_route_and_method(server):
    _assert_error(httpx.get(f"{server.url}/v1/nope"), 404)
    _assert_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="test-model", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=2)


def test_still_serving_after_bad_inputs(server, client):
    r = httpx.post(f"{server.url}/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    # A bad streaming request fails before the stream starts (status, not an in-band error).
    r = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "stream": True, "temperature": -1})
    _assert_error(r, 400, "temperature")
