"""``pagedllm serve`` with its engine cores in their own processes: what a killed engine, two engines and
prefix-aware routing look like from the outside (HTTP, /health, /metrics, the process tree)."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def add(a, b):", "Three primes:"]
# Four "system prompts" of ~130 tokens, each shared by several users (a prefix-repetition workload).
SYSTEMS = [f"System prompt {s}: you are a careful assistant for team {s}. " * 12 for s in range(4)]


def _engines(server) -> list[psutil.Process]:
    """The server's engine-core processes (multiprocessing spawn children running run_engine_core)."""
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    return [k for k in kids if "spawn_main" in " ".join(k.cmdline())]


def _samples(server, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def _greedy(client, prompts: list[str], max_tokens: int = 16) -> list[str]:
    return [client.completions.create(model="test-model", prompt=p, max_tokens=max_tokens,
                                      temperature=0).choices[0].text for p in prompts]


def _hit_rate(server, client) -> float:
    def counters() -> tuple[float, float]:
        return (sum(_samples(server, "vllm:prefix_cache_queries_total").values()),
                sum(_samples(server, "vllm:prefix_cache_hits_total").values()))

    q0, h0 = counters()
    # Three waves of 8 requests (2 per system prompt), concurrent within a wave.
    def ask(user: int) -> None:
        client.completions.create(model="test-model", prompt=SYSTEMS[user % 4] + f"User {user} asks:", max_tokens=2,
                                  temperature=0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for wave in range(3):
            list(pool.map(ask, range(wave * 8, wave * 8 + 8)))
    q1, h1 = counters()
    return (h1 - h0) / (q1 - q0)


def test_killed_engine_fails_streams_and_health(remote_server_cls):
    server = remote_server_cls(["--served-model-name", "test-model"])
    try:
        engines = _engines(server)
        assert len(engines) == 1
        everything = [server.proc.pid, *(k.pid for k in psutil.Process(server.proc.pid).children(recursive=True))]

        def stream(prompt: str) -> tuple[str, float]:
            with httpx.Client(timeout=60) as http, http.stream(
                    "POST", f"{server.url}/v1/completions",
                    json={"model": "test-model", "prompt": prompt, "max_tokens": 1500, "temperature": 0,
                          "ignore_eos": True, "stream": True}) as resp:
                body = "".join(resp.iter_text())
            return body, time.monotonic()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, p) for p in PROMPTS]
            time.sleep(2.0)
            engines[0].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            bodies = [f.result(timeout=40) for f in futures]
        for body, ended_at in bodies:
            assert ended_at - killed_at < 30
            assert '"error"' in body and "killed by signal 9" in body, body[-300:]
        deadline = time.monotonic() + 15
        while httpx.get(f"{server.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 15 s after the engine died"
            time.sleep(0.2)
        assert "engine 0" in server.log() and "killed by signal 9" in server.log()
        late = httpx.post(f"{server.url}/v1/completions", json={"model": "test-model", "prompt": "hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["message"]
    finally:
        server.stop()
    time.sleep(0.5)
    assert [p for p in everything if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] == []


def test_two_engines_equal_one_and_route_by_prefix(remote_server_cls, server, client):
    dp = remote_server_cls(["--served-model-name", "test-model", "--data-parallel-size", "2"])
    try:
        pids = [e.pid for e in _engines(dp)]
        assert len(pids) == 2
        dp_client = dp.client()
        assert _greedy(dp_client, PROMPTS) == _greedy(client, PROMPTS)
        running = _samples(dp, "vllm:num_requests_running")
        assert {dict(k)["engine"] for k in running} == {"0", "1"}
        # Prefix-aware routing keeps each system prompt on one engine: the hit rate stays that of one engine
        # (round robin would compute every prefix on both).
        one_engine = _hit_rate(server, client)
        two_engines = _hit_rate(dp, dp_client)
        assert one_engine > 0.5
        assert two_engines >= one_engine - 0.10, (one_engine, two_engines)
        queries = _samples(dp, "vllm:prefix_cache_queries_total")
        assert all(v > 0 for v in queries.values()) and len(queries) == 2  # both engines served some
    finally:
        dp.stop()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_balance_beats_the_cache_past_the_threshold(remote_server_cls):
    """Every prompt shares one prefix (the cache says: one engine), but with more requests in flight than the
    balance threshold the second engine gets work too."""
    dp = remote_server_cls(["--served-model-name", "test-model", "--data-parallel-size", "2",
                            "--routing-balance-abs-threshold", "2", "--routing-balance-rel-threshold", "1.5"])
    try:
        dp_client = dp.client()
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda i: dp_client.completions.create(
                model="test-model", prompt=SYSTEMS[0] + f"User {i}:", max_tokens=24, temperature=0, extra_body={
                    "ignore_eos": True}), range(12)))
        steps = _samples(dp, "vllm:iteration_tokens_total_count")
        per_engine = {dict(k)["engine"]: v for k, v in steps.items()}
        assert per_engine.get("0", 0) > 0 and per_engine.get("1", 0) > 0, per_engine
    finally:
        dp.stop()
