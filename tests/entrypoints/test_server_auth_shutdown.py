"""A second server with an API key (from the environment), a small body limit and CORS; SIGTERM drains."""

from __future__ import annotations

import signal
import threading

import httpx
import openai
import pytest

# Starts a server on the default model. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def auth_server(remote_server_cls):
    srv = remote_server_cls(["--shutdown-timeout", "30", "--max-request-body-bytes", "100000",
                        "--allowed-origins", '["https://example.com"]'], env={"PAGEDLLM_API_KEY": KEY})
    try:
        yield srv
    finally:
        srv.stop(signal.SIGKILL)


def test_api_key_required_on_v1(auth_server):
    url = auth_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        auth_server.client(api_key="nope").models.list()
    assert auth_server.client(api_key=KEY).models.list().data
    # Operational routes stay open (load balancers and Prometheus have no key).
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_agent_apis_behind_the_key(auth_server):
    """The Messages API takes the key as Anthropic's clients send it (x-api-key) and refuses in its own shape;
    the Responses API is behind the key too."""
    import anthropic

    url = auth_server.url
    r = httpx.post(f"{url}/v1/messages/count_tokens", headers={"x-api-key": "wrong"},
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    model = auth_server.client(api_key=KEY).models.list().data[0].id
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    assert client.messages.count_tokens(model=model, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    assert httpx.get(f"{url}/v1/responses/resp_x").status_code == 401


def test_body_limit_and_cors(auth_server):
    url, auth = auth_server.url, {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/completions", headers=auth,
                   json={"prompt": "x" * 200_000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunked():
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"y" * 5000
        yield b'", "max_tokens": 1}'

    r = httpx.post(f"{url}/v1/completions", headers={**auth, "content-type": "application/json"},
                   content=chunked())
    assert r.status_code == 413
    pre = httpx.options(f"{url}/v1/completions", headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://example.com"


def test_sigterm_drains_in_flight_then_exits_zero(auth_server):
    client = auth_server.client(api_key=KEY)
    chunks: list = []
    errors: list = []
    first = threading.Event()

    def consume() -> None:
        try:
            for chunk in client.completions.create(model="smollm2", prompt="Count: 1, 2,", max_tokens=16,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                chunks.append(chunk)
                first.set()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            first.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert first.wait(60)
    auth_server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert not errors, errors
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    assert auth_server.proc.wait(30) == 0
    # Nothing listens any more.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{auth_server.url}/health", timeout=2)
