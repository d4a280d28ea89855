"""`pagedllm proxy` against stand-in instances (no model): what it sends to the prefill and decode instances,
streaming through, API keys, a dead or wrongly configured prefill instance, /health, and the pick policies."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.disagg_proxy import InstancePool, ProxyConfig, build_app

from helpers.disagg_servers import free_port

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "p0",
          "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "cmpl-1-0"}


def _fake_instance(kind: str, seen: list, give_params: bool = True) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"data": [{"id": "m"}]})

    async def handle(request: Request):
        body = await request.json()
        seen.append((body, dict(request.headers)))
        if kind == "prefill":
            return JSONResponse({"choices": [{"text": "p"}], "kv_transfer_params": PARAMS if give_params else None})
        if body.get("stream"):
            async def chunks():
                for piece in ("Hel", "lo"):
                    yield f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "Hello"}], "usage": {"prompt_tokens": 5}})

    app.post("/v1/completions")(handle)
    app.post("/v1/chat/completions")(handle)
    return app


class _Served:
    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def instances():
    seen = {"prefill": [], "decode": [], "bad": []}
    served = {"prefill": _Served(_fake_instance("prefill", seen["prefill"])),
              "decode": _Served(_fake_instance("decode", seen["decode"])),
              "bad": _Served(_fake_instance("prefill", seen["bad"], give_params=False))}
    yield served, seen
    for s in served.values():
        s.stop()


def _call(config: ProxyConfig, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(config))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


def test_prefill_then_decode_with_the_returned_params(instances) -> None:
    served, seen = instances
    config = ProxyConfig([served["prefill"].url], [served["decode"].url])
    r = _call(config, "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 9,
                                                       "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello"
    first, _ = seen["prefill"][-1]
    assert first["max_tokens"] == 1 and first["stream"] is False and "stream_options" not in first
    assert first["kv_transfer_params"] == {"do_remote_decode": True} and first["prompt"] == "hi"
    second, headers = seen["decode"][-1]
    assert second["kv_transfer_params"] == PARAMS and second["max_tokens"] == 9
    assert headers["x-request-id"] == seen["prefill"][-1][1]["x-request-id"]  # one id on both sides


def test_min_tokens_is_capped_for_the_prefill_leg_only(instances) -> None:
    """A client's min_tokens (benchmarks send min_tokens = max_tokens) would make max_tokens = 1 invalid there."""
    served, seen = instances
    config = ProxyConfig([served["prefill"].url], [served["decode"].url])
    r = _call(config, "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 9,
                                                       "min_tokens": 9, "ignore_eos": True})
    assert r.status_code == 200
    first, _ = seen["prefill"][-1]
    assert first["max_tokens"] == 1 and first["min_tokens"] == 1 and first["ignore_eos"] is True
    second, _ = seen["decode"][-1]
    assert second["max_tokens"] == 9 and second["min_tokens"] == 9


def test_chat_streams_through(instances) -> None:
    served, seen = instances
    config = ProxyConfig([served["prefill"].url], [served["decode"].url])
    r = _call(config, "POST", "/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_completion_tokens": 5})
    assert r.status_code == 200
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
             if line.startswith("data: {")]
    assert texts == ["Hel", "lo"] and r.text.rstrip().endswith("data: [DONE]")
    assert seen["prefill"][-1][0]["max_completion_tokens"] == 1
    assert seen["decode"][-1][0]["stream"] is True


def test_api_keys(instances) -> None:
    served, seen = instances
    config = ProxyConfig([served["prefill"].url], [served["decode"].url], api_key="outer", instance_api_key="inner")
    denied = _call(config, "POST", "/v1/completions", json={"prompt": "hi"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == 401
    assert _call(config, "GET", "/v1/models").status_code == 401
    ok = _call(config, "POST", "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer outer"})
    assert ok.status_code == 200
    assert seen["prefill"][-1][1]["authorization"] == "Bearer inner"
    assert seen["decode"][-1][1]["authorization"] == "Bearer inner"


def test_dead_prefill_instance(instances) -> None:
    served, seen = instances
    dead = f"http://127.0.0.1:{free_port()}"
    only_dead = ProxyConfig([dead], [served["decode"].url], connect_timeout_s=1.0)
    started = time.monotonic()
    r = _call(only_dead, "POST", "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and "prefill" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5
    assert _call(only_dead, "GET", "/health").status_code == 503
    # With a live one beside it, the dead instance is skipped.
    both = ProxyConfig([dead, served["prefill"].url], [served["decode"].url], policy="round-robin")
    for _ in range(2):
        assert _call(both, "POST", "/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_prefill_without_kv_transfer_params_is_a_502(instances) -> None:
    served, _ = instances
    config = ProxyConfig([served["bad"].url], [served["decode"].url])
    r = _call(config, "POST", "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and "kv_producer" in r.json()["error"]["message"]


def test_health_models_and_bad_requests(instances) -> None:
    served, _ = instances
    config = ProxyConfig([served["prefill"].url], [served["decode"].url])
    health = _call(config, "GET", "/health")
    assert health.status_code == 200 and set(health.json()["instances"].values()) == {"ok"}
    assert _call(config, "GET", "/v1/models").json()["data"][0]["id"] == "m"
    assert _call(config, "POST", "/v1/completions", content=b"{nope").status_code == 400
    r = _call(config, "POST", "/v1/completions", json={"prompt": "hi", "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_pick_policies() -> None:
    pool = InstancePool("decode", ["a", "b", "c"], "least-loaded")
    pool.in_flight.update({"a": 2, "b": 0, "c": 1})
    assert pool.order()[0] == "b"
    rr = InstancePool("decode", ["a", "b"], "round-robin")
    assert [rr.order()[0] for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="decode"):
        build_app(ProxyConfig(["x"], []))
