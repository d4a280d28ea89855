"""Online serving benchmark: ``pagedllm bench serve``.

Sends random token-id prompts to a running OpenAI-compatible server's ``/v1/completions`` with streaming,
arriving as a Poisson process at ``--request-rate`` (``inf``: all at once), optionally capped at
``--max-concurrency`` in flight. Measures per request the time to first token (TTFT), the gaps between
streamed chunks (ITL), the time per output token after the first (TPOT) and the end-to-end latency (E2EL),
and reports them with vLLM's key names (``median_ttft_ms``, ``p99_itl_ms``, ``request_throughput``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pagedllm.benchmarks.datasets import SampledRequest, add_dataset_args, random_requests

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    """What one streamed request measured; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0  # generated tokens (server-reported usage when available)
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token-bearing chunks
    latency: float = 0.0  # end to end
    error: str = ""


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="Server address (default: http://127.0.0.1:8000).")
    group.add_argument("--endpoint", default="/v1/completions",
                       help="API path: /v1/completions (default), /v1/chat/completions or /v1/responses (the "
                            "prompt as one user message's text; every request still runs to --output-len).")
    group.add_argument("--model", default="smollm2",
                       help="Model name sent in each request (default: smollm2).")
    group.add_argument("--tokenizer", default=None,
                       help="Model whose tokenizer the prompt ids are drawn from: a short name, .gguf file "
                            "or HF folder (default: --model if it resolves locally, else the default model).")
    group.add_argument("--api-key", default=None, help="Sent as a Bearer token, if given.")
    group.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                       help="Send prompts as token-id lists (exact lengths; default) or as text decoded from "
                            "them (the server re-tokenizes, so lengths may drift).")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Requests per second, Poisson arrivals; inf sends all at once (default: inf).")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="Most requests in flight at once (default: no limit).")
    load.add_argument("--seed", type=int, default=0,
                      help="Seed of the prompts and arrival times (default: 0).")
    load.add_argument("--temperature", type=float, default=1.0,
                      help="Sampling temperature sent (default: 1.0).")
    load.add_argument("--metric-percentiles", default="90,99",
                      help="Comma-separated percentiles to report besides the median (default: 90,99).")
    load.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    load.add_argument("--save-detailed", action="store_true",
                      help="Also put per-request TTFTs, ITLs, lengths and errors in the JSON.")
    load.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_dataset_args(parser, num_prompts=100)
    return parser


def arrival_delays(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or all 0 for inf."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    return rng.exponential(1.0 / request_rate, size=num_requests).tolist()


def _parse_sse_line(line: str) -> dict[str, Any] | None:
    """One ``data: {...}`` line of a server-sent event stream → its JSON; None for anything else."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


async def send_completion(client: Any, url: str, payload: dict[str, Any], prompt_len: int,
                          headers: dict[str, str] | None = None) -> RequestResult:
    """POST one streaming completion request and time its chunks."""
    result = RequestResult(prompt_len=prompt_len)
    text_parts: list[str] = []
    usage_tokens: int | None = None
    num_chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                data = _parse_sse_line(line)
                if data is None:
                    continue
                now = time.perf_counter()
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens", usage_tokens)
                    # Text prompts are re-tokenized by the server: trust its count of the prompt too.
                    result.prompt_len = data["usage"].get("prompt_tokens") or result.prompt_len
                if data.get("type") == "response.completed":  # the Responses API's last event
                    usage = data["response"].get("usage") or {}
                    usage_tokens = usage.get("output_tokens", usage_tokens)
                    result.prompt_len = usage.get("input_tokens") or result.prompt_len
                    continue
                if data.get("type") is not None:
                    if data["type"] != "response.output_text.delta":
                        continue
                    text = data.get("delta") or ""
                else:
                    choices = data.get("choices") or []
                    if not choices:
                        continue
                    choice = choices[0]
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    # A chunk with only a finish_reason carries no token; one with empty text and no
                    # finish_reason still does (the detokenizer held back a partial character); a chat
                    # stream's first chunk carries only the role.
                    if not text and (choice.get("finish_reason") is not None
                                     or (choice.get("delta") or {}).get("role")):
                        continue
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
                text_parts.append(text)
        result.latency = time.perf_counter() - start
        result.generated_text = "".join(text_parts)
        result.output_len = usage_tokens if usage_tokens is not None else num_chunks
        result.success = num_chunks > 0
        if not result.success:
            result.error = "the stream carried no tokens"
    except Exception as e:  # a failed request is counted, not fatal to the benchmark
        result.error = f"{type(e).__name__}: {e}"
    return result


def build_payload(model: str, request: SampledRequest, prompt_format: str, tokenizer: Any,
                  temperature: float, endpoint: str = "/v1/completions") -> dict[str, Any]:
    prompt: Any = request.prompt_token_ids
    if prompt_format == "text" or not endpoint.endswith("/completions") or endpoint.endswith("/chat/completions"):
        prompt = tokenizer.decode(request.prompt_token_ids)
    # vLLM-style extra body: run every request to max_tokens so all servers do the same work.
    same_work = {"ignore_eos": True, "min_tokens": request.expected_output_len}
    if endpoint.endswith("/chat/completions"):
        return {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": request.expected_output_len, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}, **same_work}
    if endpoint.endswith("/responses"):
        return {"model": model, "input": prompt, "max_output_tokens": request.expected_output_len,
                "temperature": temperature, "stream": True, **same_work}
    return {
        "model": model, "prompt": prompt, "max_tokens": request.expected_output_len,
        "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
        # vLLM-style extra body: run every request to max_tokens so all servers do the same work.
        "ignore_eos": True, "min_tokens": request.expected_output_len,
    }


async def run_benchmark(url: str, payloads: list[dict[str, Any]], prompt_lens: list[int],
                        delays: list[float], max_concurrency: int | None = None,
                        headers: dict[str, str] | None = None, transport: Any = None,
                        use_tqdm: bool = True) -> tuple[list[RequestResult], float]:
    """Send every payload after its arrival delay; returns the results (in order) and the wall time (s)."""
    import httpx

    limit = max_concurrency or len(payloads)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(payloads), desc="Requests", disable=not use_tqdm, dynamic_ncols=True)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)  # long generations must not time out

    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        async def one(payload: dict[str, Any], prompt_len: int) -> RequestResult:
            async with semaphore:
                result = await send_completion(client, url, payload, prompt_len, headers)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for payload, prompt_len, delay in zip(payloads, prompt_lens, delays, strict=True):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(payload, prompt_len)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _stats(prefix: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/pNN of ``values_s`` (seconds) in milliseconds; zeros when there are none."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
           f"std_{prefix}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = float(np.percentile(ms, p))
    return out


def calculate_metrics(results: list[RequestResult], duration: float,
                      percentiles: list[float] = (99,)) -> dict[str, Any]:
    """Aggregate per-request measurements over a run of ``duration`` seconds (vLLM's key names)."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    # TPOT: time after the first token divided by the tokens after it (requests with 1 token have none).
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats(name, values, list(percentiles)))
    return metrics


def prefix_cache_counters(base_url: str, headers: dict[str, str] | None) -> tuple[float, float] | None:
    """(queries, hits) of the server's prefix cache in tokens, summed over its engines, from ``/metrics`` (vLLM's
    names); None when the server exposes no such metrics."""
    import httpx

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    seen = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    return (totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]) if seen else None


def print_summary(metrics: dict[str, Any], percentiles: list[float]) -> None:
    width = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="="))
    rows = [("Successful requests:", metrics["completed"]), ("Failed requests:", metrics["failed"]),
            ("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
            ("Total input tokens:", metrics["total_input_tokens"]),
            ("Total generated tokens:", metrics["total_output_tokens"]),
            ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for name in METRICS:
        print("{s:{c}^{n}}".format(s=f" {METRIC_NAMES[name]} ", n=width, c="-"))
        print(f"{f'Mean {name.upper()} (ms):':<40}{metrics[f'mean_{name}_ms']:<10.2f}")
        print(f"{f'Median {name.upper()} (ms):':<40}{metrics[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} {name.upper()} (ms):':<40}{metrics[f'p{p:g}_{name}_ms']:<10.2f}")
    print("=" * width)


def _load_tokenizer(name: str | None, model: str) -> Any:
    """The tokenizer prompts are drawn from: --tokenizer, else --model when it resolves here, else default."""
    from pagedllm.config import DEFAULT_MODEL, ModelConfig
    from pagedllm.model_executor.loader import load_tokenizer

    for candidate in ([name] if name else [model, DEFAULT_MODEL]):
        try:
            return load_tokenizer(ModelConfig(model=candidate))
        except ValueError as e:
            if name:
                raise
            if candidate != DEFAULT_MODEL:
                print(f"note: {candidate!r} is not a local model ({e}); drawing prompts from the "
                      f"default model's tokenizer ({DEFAULT_MODEL}); pass --tokenizer to choose")
    raise ValueError("tokenizer: could not load one")


def _parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise ValueError(f"metric_percentiles: expected comma-separated numbers, got {text!r}") from e
    if any(not 0 < p < 100 for p in values):
        raise ValueError(f"metric_percentiles: each must be in (0, 100), got {text!r}")
    return values


def main(args: argparse.Namespace) -> dict[str, Any]:
    percentiles = _parse_percentiles(args.metric_percentiles)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
    tokenizer = _load_tokenizer(args.tokenizer, args.model)
    requests = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                               prefix_len=args.prefix_len, seed=args.seed, num_prefixes=args.num_prefixes)
    payloads = [build_payload(args.model, r, args.prompt_format, tokenizer, args.temperature, args.endpoint)
                for r in requests]
    delays = arrival_delays(len(requests), args.request_rate, args.seed)
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    print(f"Sending {len(requests)} requests to {url} at {args.request_rate:g} req/s "
          f"(max concurrency {args.max_concurrency or 'unlimited'})")
    cache_before = prefix_cache_counters(args.base_url, headers)
    results, duration = asyncio.run(run_benchmark(url, payloads, [r.prompt_len for r in requests], delays,
                                                  args.max_concurrency, headers,
                                                  use_tqdm=not args.disable_tqdm))
    metrics = calculate_metrics(results, duration, percentiles)
    cache_after = prefix_cache_counters(args.base_url, headers)
    if cache_before is not None and cache_after is not None:
        queries, hits = (after - before for after, before in zip(cache_after, cache_before))
        metrics["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    print_summary(metrics, percentiles)
    if "prefix_cache_hit_rate" in metrics:
        print(f"{'Prefix cache hit rate (server):':<40}{metrics['prefix_cache_hit_rate'] * 100:.1f}%")
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}")
    # JSON has no infinity: write the rate as a string then.
    rate: float | str = "inf" if math.isinf(args.request_rate) else args.request_rate
    backend = ("openai-chat" if args.endpoint.endswith("/chat/completions") else
               "openai-responses" if args.endpoint.endswith("/responses") else "openai-completions")
    metrics.update(backend=backend, base_url=args.base_url, endpoint=args.endpoint,
                   model=args.model, num_prompts=args.num_prompts, request_rate=rate,
                   max_concurrency=args.max_concurrency, input_len=args.input_len, output_len=args.output_len,
                   prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, prompt_format=args.prompt_format,
                   seed=args.seed)
    if args.save_detailed:
        metrics.update(input_lens=[r.prompt_len for r in results],
                       output_lens=[r.output_len for r in results], ttfts=[r.ttft for r in results],
                       itls=[r.itl for r in results],
                       e2els=[r.latency for r in results], errors=[r.error for r in results])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics

