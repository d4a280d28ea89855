"""Disaggregated prefill and decode end to end: a prefill and a decode `pagedllm serve` over NIXL behind
`pagedllm proxy`, on the default model. Greedy outputs through the proxy equal a plain instance's (completions
and chat, streamed or not, prompts of several blocks with partial last blocks); the decode instance computes
only the last prompt token, the prefill instance generates one token per request; aborts, a producer nobody
reads from, a failed transfer and a dead prefill instance leave no KV block behind and the decode side healthy.
One set of servers for the module (the last test stops the prefill instance)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import pytest

from helpers.disagg_servers import Process, metric, serve, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SENTENCE = "The old lighthouse keeper climbed the stairs every evening to light the lamp for the ships. "
# 4 and 6 blocks of 16 tokens, neither a whole number of blocks (checked below).
PROMPTS = [SENTENCE * 3, "Tell me a story. " + SENTENCE * 4 + "And then"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster():
    prefill = serve("prefill", {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"abort_request_timeout": 4}})
    decode = serve("decode", {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    procs = [prefill, decode]
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        proxy = Process("proxy", ["proxy", "--prefill", prefill.url, "--decode", decode.url,
                                  "--connect-timeout", "1"])
        procs.append(proxy)
        proxy.wait_healthy()
        yield prefill, decode, proxy
    finally:
        for p in reversed(procs):
            p.stop()


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json={"model": "test-model", "temperature": 0.0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(url: str, path: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", url + path, json={"model": "test-model", "temperature": 0.0, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def _kv_usage(url: str) -> float:
    return metric(url, "vllm:kv_cache_usage_perc")


def _idle(*procs: Process) -> None:
    wait_for(lambda: all(_kv_usage(p.url) == 0.0 for p in procs), 20, "KV cache usage back to 0")


@pytest.fixture(scope="module")
def reference(cluster) -> dict:
    """Each prompt's greedy output on the prefill instance alone (a salt keeps its prefix cache apart)."""
    prefill, _, _ = cluster
    out = {}
    for p in PROMPTS:
        out[("cmpl", p)] = _post(prefill.url, "/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS,
                                                                  "cache_salt": "ref"})["choices"][0]["text"]
        out[("chat", p)] = _post(prefill.url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS,
            "cache_salt": "ref"})["choices"][0]["message"]["content"]
    return out


def test_prompts_span_partial_blocks(cluster) -> None:
    prefill, _, _ = cluster
    for p in PROMPTS:
        n = len(httpx.post(prefill.url + "/tokenize", json={"model": "test-model", "prompt": p}).json()["tokens"])
        assert n > 3 * 16 and n % 16, n


def test_outputs_through_the_proxy_equal_a_single_instance(cluster, reference) -> None:
    prefill, decode, proxy = cluster
    before = {s: metric(decode.url, "vllm:prompt_tokens_by_source_total", source=s)
              for s in ("local_compute", "external_kv_transfer")}
    gen_before = metric(prefill.url, "vllm:generation_tokens_total")
    num_requests = 0
    for i, p in enumerate(PROMPTS):  # each kind of request once, each prompt streamed and not
        out = _post(proxy.url, "/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS})
        assert out["choices"][0]["text"] == reference[("cmpl", p)]
        usage = out["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        messages = [{"role": "user", "content": p}]
        if i == 0:
            assert _stream_text(proxy.url, "/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS}) == \
                reference[("cmpl", p)]
            chat = _post(proxy.url, "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS})
            assert chat["choices"][0]["message"]["content"] == reference[("chat", p)]
        else:
            assert _stream_text(proxy.url, "/v1/chat/completions",
                                {"messages": messages, "max_tokens": MAX_TOKENS}) == reference[("chat", p)]
        num_requests += 3 if i == 0 else 2
    # The decode instance computed one prompt token per request (the last, for its logits), and the prefill
    # instance generated one token per request.
    wait_for(lambda: metric(decode.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
             - before["local_compute"] == num_requests, 10, "decode metrics")
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > \
        before["external_kv_transfer"] + num_requests * 3 * 16
    assert metric(prefill.url, "vllm:generation_tokens_total") - gen_before == num_requests
    _idle(prefill, decode)


def test_sixteen_concurrent_requests(cluster, reference) -> None:
    prefill, decode, proxy = cluster

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i: int) -> str:
                r = await client.post(proxy.url + "/v1/completions", json={
                    "model": "test-model", "prompt": PROMPTS[i % 2], "max_tokens": MAX_TOKENS, "temperature": 0.0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            return await asyncio.gather(*(one(i) for i in range(16)))

    texts = asyncio.run(run())
    assert texts == [reference[("cmpl", PROMPTS[i % 2])] for i in range(16)]
    _idle(prefill, decode)


def test_client_disconnect_mid_stream_frees_every_block(cluster) -> None:
    prefill, decode, proxy = cluster
    for _ in range(2):
        with httpx.stream("POST", proxy.url + "/v1/completions", timeout=120, json={
                "model": "test-model", "prompt": PROMPTS[1], "max_tokens": 200, "stream": True,
                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leave after the first token
    _idle(prefill, decode)
    assert httpx.get(decode.url + "/health").status_code == 200


def test_client_gone_while_the_blocks_are_arriving_frees_every_block(cluster, reference) -> None:
    """A decode request aborted while it waits for its KV: the producer's side channel answers nothing (a socket
    that accepts and stays silent), so the request sits in WAITING_FOR_REMOTE_KVS with its blocks allocated when
    the client hangs up. Every block comes back on both sides, the abort is no failed transfer, and the decode
    instance then serves the same prompt correctly."""
    prefill, decode, _ = cluster
    failures = metric(decode.url, "pagedllm:kv_transfer_failures_total")
    # A salt of its own: neither instance has these blocks cached from the tests before.
    params = _post(prefill.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 1, "cache_salt": "hang-up",
                                                    "kv_transfer_params": {"do_remote_decode": True}})
    with socket.create_server(("127.0.0.1", 0)) as silent:
        stalled = {**params["kv_transfer_params"], "remote_port": silent.getsockname()[1]}

        async def hang_up() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                task = asyncio.create_task(client.post(decode.url + "/v1/completions", json={
                    "model": "test-model", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "cache_salt": "hang-up", "kv_transfer_params": stalled}))
                await asyncio.to_thread(wait_for, lambda: _kv_usage(decode.url) > 0, 20,
                                        "the decode instance holding blocks for the arriving KV")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        asyncio.run(hang_up())
        _idle(prefill, decode)
    assert metric(decode.url, "pagedllm:kv_transfer_failures_total") == failures
    out = _post(decode.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS})
    assert out["choices"][0]["text"] == reference[("cmpl", PROMPTS[1])]
    _idle(decode)


def test_unread_blocks_are_freed_after_the_timeout(cluster) -> None:
    prefill, _, _ = cluster
    out = _post(prefill.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 1,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
    assert out["kv_transfer_params"]["remote_block_ids"]
    assert _kv_usage(prefill.url) > 0  # held for a reader that never comes
    started = time.monotonic()
    _idle(prefill)
    assert time.monotonic() - started < 15


def test_failed_transfer_falls_back_to_recompute(cluster, reference) -> None:
    prefill, decode, _ = cluster
    failures = metric(decode.url, "pagedllm:kv_transfer_failures_total")
    params = _post(prefill.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 1,
                                                    "kv_transfer_params": {"do_remote_decode": True}})
    bogus = {**params["kv_transfer_params"], "remote_engine_id": "not-that-engine"}
    out = _post(decode.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                "kv_transfer_params": bogus})
    assert out["choices"][0]["text"] == reference[("cmpl", PROMPTS[0])]
    wait_for(lambda: metric(decode.url, "pagedllm:kv_transfer_failures_total") == failures + 1, 10, "failure count")
    _idle(prefill, decode)  # the prefill instance's unread blocks time out too


def test_dead_prefill_instance_fails_fast_and_decode_stays_healthy(cluster, reference) -> None:
    prefill, decode, proxy = cluster
    prefill.stop()
    started = time.monotonic()
    r = httpx.post(proxy.url + "/v1/completions", timeout=60, json={"model": "test-model", "prompt": PROMPTS[0],
                                                                     "max_tokens": 4})
    assert r.status_code in (502, 503) and "error" in r.json()
    assert time.monotonic() - started < 10
    assert httpx.get(proxy.url + "/health").status_code == 503
    assert httpx.get(decode.url + "/health").status_code == 200
    # The decode instance still serves on its own.
    out = _post(decode.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert out["choices"][0]["text"] == reference[("cmpl", PROMPTS[0])]
    _idle(decode)
