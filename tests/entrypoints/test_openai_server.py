"""The server through the real ``openai`` client: completions, chat, streaming, usage, logprobs, n, stop,
seeds, models, tokenization, concurrency, disconnects, metrics and tools without tool_choice."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# Starts a server on the default model. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def metrics(server) -> dict[tuple[str, tuple], float]:
    """All samples at /metrics, keyed by (sample name, sorted labels)."""
    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lbl), v in samples.items() if n == name and all(dict(lbl).get(k) == x
                                                                      for k, x in labels.items()))


def test_models(client, server, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].model_extra["max_model_len"] == 2048
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_basic_and_usage(client, model_name):
    resp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.model == model_name
    assert choice.text and choice.finish_reason == "length"
    prompt_ids = client.post("/../tokenize", body={"prompt": PROMPT}, cast_to=object)["tokens"]
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == len(prompt_ids) + 6
    # Only full KV blocks (16 tokens) are shared; this prompt is shorter than one, so nothing is ever cached.
    assert len(prompt_ids) < 16 and resp.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_equals_non_streaming(client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_prompt_forms(client, model_name):
    ids = client.post("/../tokenize", body={"prompt": PROMPT}, cast_to=object)["tokens"]
    by_text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=model_name, prompt=[PROMPT, "One, two,"], max_tokens=4,
                                     temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text


def test_echo_and_logprobs_shape(client, model_name):
    resp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                     logprobs=3, echo=True)
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    n_prompt = resp.usage.prompt_tokens
    lengths = {len(lp.tokens), len(lp.token_logprobs), len(lp.top_logprobs), len(lp.text_offset)}
    assert lengths == {n_prompt + 4}
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Greedy: the sampled token is the most likely one.
    for tok, top, tlp in zip(lp.tokens[n_prompt:], lp.top_logprobs[n_prompt:], lp.token_logprobs[n_prompt:],
                             strict=True):
        assert max(top.values()) == pytest.approx(tlp) and top[tok] == pytest.approx(tlp)


def test_chat(client, model_name):
    resp = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=8,
                                          temperature=0)
    msg = resp.choices[0].message
    assert resp.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 5
    # max_tokens (the older name) works too and gives the same greedy text.
    again = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == msg.content


def test_chat_streaming_and_logprobs(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == full.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_and_seed(client, model_name):
    resp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3,
                                     seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens <= 18
    again = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3,
                                      seed=7)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    chat = [client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6, temperature=1.0,
                                           seed=11).choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]


def test_stop(client, model_name):
    full = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text.strip()[:2] if len(text.strip()) >= 2 else None
    assert stop, text
    resp = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                     stop=[stop])
    assert resp.choices[0].finish_reason == "stop" and stop not in resp.choices[0].text
    assert text.startswith(resp.choices[0].text)


def test_tokenize_detokenize_round_trip(server, model_name):
    body = {"model": model_name, "prompt": "Hello paged world!"}
    tok = httpx.post(f"{server.url}/tokenize", json=body).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048
    detok = httpx.post(f"{server.url}/detokenize", json={"model": model_name, "tokens": tok["tokens"]}).json()
    assert detok["prompt"].endswith("Hello paged world!")
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tok["count"]


def test_concurrent_streams_match_solo(server, client, model_name):
    prompts = [f"Story {i}: once upon a time" for i in range(16)] * 2
    solo = {p: client.completions.create(model=model_name, prompt=p, max_tokens=8,
                                         temperature=0).choices[0].text for p in set(prompts)}

    async def stream_one(aclient, prompt: str) -> str:
        parts = []
        async for chunk in await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                                            temperature=0, stream=True):
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    async def run_all() -> list[str]:
        async with server.async_client() as aclient:
            return await asyncio.gather(*[stream_one(aclient, p) for p in prompts])

    start = time.monotonic()
    results = asyncio.run(run_all())
    assert len(results) == 32
    assert results == [solo[p] for p in prompts]
    assert time.monotonic() - start < 60


def _metrics_once_idle(server, timeout: float) -> dict[tuple[str, tuple], float]:
    """The server's metrics once no request runs and no KV block is used, or the last ones after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = metric(m, "vllm:kv_cache_usage_perc") == 0 and metric(m, "vllm:num_requests_running") == 0
        if idle or time.monotonic() >= deadline:
            return m
        time.sleep(0.1)


def test_client_disconnect_frees_kv(server, client, model_name):
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{server.url}/v1/completions",
            json={"model": model_name, "prompt": PROMPT * 20, "max_tokens": 1000, "temperature": 0,
                  "ignore_eos": True, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert metric(metrics(server), "vllm:kv_cache_usage_perc") > 0
    m = _metrics_once_idle(server, 10)
    assert metric(m, "vllm:kv_cache_usage_perc") == 0
    assert metric(m, "vllm:num_requests_running") == 0
    # And it still serves.
    again = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert again.choices[0].text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_gone_before_a_non_streamed_answer_aborts_it(server, model_name, path):
    """A non-streamed request's only output is its last, so the server watches for the client leaving from the
    start: the request is aborted, not generated to its 1,000 tokens for nobody."""
    gen = "vllm:generation_tokens_total"
    before = metric(metrics(server), gen)
    body = {"model": model_name, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": PROMPT}]})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{path}", json=body, timeout=httpx.Timeout(60, read=1.0))
    m = _metrics_once_idle(server, 30)
    assert metric(m, "vllm:num_requests_running") == 0
    assert metric(m, "vllm:kv_cache_usage_perc") == 0
    assert metric(m, gen) - before < 600, "the request ran on after its client left"


def test_metrics_counters_move(server, client, model_name):
    before = metrics(server)
    resp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0)
    after = metrics(server)
    label = {"model_name": model_name}
    assert metric(after, "vllm:prompt_tokens_total", **label) - metric(before, "vllm:prompt_tokens_total") \
        == resp.usage.prompt_tokens
    assert metric(after, "vllm:generation_tokens_total", **label) \
        - metric(before, "vllm:generation_tokens_total") == 5
    assert metric(after, "vllm:request_success_total", finished_reason="length") \
        - metric(before, "vllm:request_success_total", finished_reason="length") == 1
    for hist in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:request_queue_time_seconds_count"):
        assert metric(after, hist) - metric(before, hist) == 1, hist
    # A non-streamed request reaches the stats once, finished, so it has no inter-token gaps to observe;
    # a streamed one reaches them token by token: 5 tokens, 4 gaps.
    itl = "vllm:inter_token_latency_seconds_count"
    assert metric(after, itl) - metric(before, itl) == 0
    steps = "vllm:iteration_tokens_total_count"
    assert metric(after, steps) > metric(before, steps)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert metric(metrics(server), itl) - metric(after, itl) == 4
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert any(n == name for n, _ in after), name


def test_prefix_cache_hits_and_reset(server, client, model_name):
    long_prompt = "A long shared system prompt about paged attention and block tables. " * 6
    client.completions.create(model=model_name, prompt=long_prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model_name, prompt=long_prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(metrics(server), "vllm:prefix_cache_hits_total") > 0
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    third = client.completions.create(model=model_name, prompt=long_prompt, max_tokens=2, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


def test_request_id_header_echo(server, model_name):
    r = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "abc-123"},
                   json={"model": model_name, "prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
# The hermes call the built-in tool ChatML template asks for. The tiny model would rarely write it unprompted,
# so a choice constraint (which tool_choice 'auto' leaves to the request) makes it write exactly this.
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tools_without_tool_choice_are_auto_on_a_default_server(client, model_name):
    """What the openai client sends in a tool loop: tools, no tool_choice. OpenAI treats it as 'auto'; the
    default server (no --enable-auto-tool-choice) parses the call with the template's parser (hermes)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"structured_outputs": {"choice": [CALL_TEXT]}}
    resp = client.chat.completions.create(model=model_name, messages=ask, tools=[WEATHER], max_tokens=40,
                                          temperature=0, extra_body=forced)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # Streamed: the same call in tool_call deltas, none of the markup as content.
    chunks = list(client.chat.completions.create(model=model_name, messages=ask, tools=[WEATHER], max_tokens=40,
                                                 temperature=0, extra_body=forced, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert "".join(d.function.name or "" for d in deltas) == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"
    # Without a call in the text, tools without tool_choice answer as plain chat.
    plain = client.chat.completions.create(model=model_name, messages=ask, tools=[WEATHER], max_tokens=4,
                                           temperature=0, extra_body={"structured_outputs": {"choice": ["Sunny"]}})
    assert plain.choices[0].message.content == "Sunny" and not plain.choices[0].message.tool_calls
