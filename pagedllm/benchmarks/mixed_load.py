"""Decode streams under a stream of long prompts: ``pagedllm bench mixed-load``.

``--num-streams`` streamed completions (``--stream-input-len`` / ``--stream-output-len``, EOS ignored) start
together; after ``--warmup-s`` seconds, long prompts (``--long-input-len`` tokens, ``--long-output-len`` out) arrive
one every ``--long-interval-s`` seconds until the streams end. Reports the streams' inter-token latency (ITL) and
the long prompts' time to first token (TTFT) with vLLM's key names. Point ``--base-url`` at one instance or at
``pagedllm proxy`` over prefill and decode instances (``benchmarks/disagg_compare.sh`` runs both side by side):
disaggregation pays when the streams' ITL p99 falls while the long prompts keep arriving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from pagedllm.benchmarks.datasets import random_requests
from pagedllm.benchmarks.serve import RequestResult, _load_tokenizer, _stats, build_payload, send_completion


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server or proxy address.")
    parser.add_argument("--model", default="smollm2", help="Model name sent in each request (default: smollm2).")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer the prompt ids come from (default: --model).")
    parser.add_argument("--api-key", default=None, help="Sent as a Bearer token, if given.")
    parser.add_argument("--num-streams", type=int, default=8, help="Decode streams (default 8).")
    parser.add_argument("--stream-input-len", type=int, default=128)
    parser.add_argument("--stream-output-len", type=int, default=512)
    parser.add_argument("--long-input-len", type=int, default=3000, help="Tokens of each long prompt (default 3000).")
    parser.add_argument("--long-output-len", type=int, default=8)
    parser.add_argument("--long-interval-s", type=float, default=2.0,
                        help="Seconds between long prompts (default 2).")
    parser.add_argument("--warmup-s", type=float, default=1.0,
                        help="Seconds of plain decoding before the first long prompt (default 1).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    return parser


async def run_mixed(url: str, streams: list[dict[str, Any]], longs: list[dict[str, Any]], stream_len: int,
                    long_len: int, interval_s: float, warmup_s: float,
                    headers: dict[str, str] | None = None) -> tuple[list[RequestResult], list[RequestResult]]:
    """The streams at once, then one long payload every ``interval_s`` while any stream runs (at most all of
    ``longs``); returns both groups' results."""
    import httpx

    timeout = httpx.Timeout(3600.0, connect=30.0)
    limits = httpx.Limits(max_connections=len(streams) + len(longs))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        stream_tasks = [asyncio.create_task(send_completion(client, url, p, stream_len, headers)) for p in streams]
        await asyncio.sleep(warmup_s)
        long_tasks = []
        for payload in longs:
            if all(t.done() for t in stream_tasks):
                break
            long_tasks.append(asyncio.create_task(send_completion(client, url, payload, long_len, headers)))
            await asyncio.sleep(interval_s)
        return list(await asyncio.gather(*stream_tasks)), list(await asyncio.gather(*long_tasks))


def main(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_streams", "stream_input_len", "stream_output_len", "long_input_len", "long_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be at least 1, got {getattr(args, name)}")
    if args.long_interval_s <= 0:
        raise ValueError(f"long_interval_s: must be positive, got {args.long_interval_s}")
    tokenizer = _load_tokenizer(args.tokenizer, args.model)
    # Enough long prompts to keep arriving for the streams' whole life; the unsent ones are never sent.
    max_longs = 4 + int(args.stream_output_len * 0.2 / args.long_interval_s)
    streams = random_requests(tokenizer, args.num_streams, args.stream_input_len, args.stream_output_len,
                              seed=args.seed)
    longs = random_requests(tokenizer, max_longs, args.long_input_len, args.long_output_len, seed=args.seed + 1)
    to_payload = lambda r: build_payload(args.model, r, "ids", tokenizer, 0.0)  # noqa: E731
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    url = args.base_url.rstrip("/") + "/v1/completions"
    start = time.perf_counter()
    stream_results, long_results = asyncio.run(run_mixed(
        url, [to_payload(r) for r in streams], [to_payload(r) for r in longs], args.stream_input_len,
        args.long_input_len, args.long_interval_s, args.warmup_s, headers))
    duration = time.perf_counter() - start
    failed = [r.error for r in stream_results + long_results if not r.success]
    itls = [gap for r in stream_results if r.success for gap in r.itl]
    result: dict[str, Any] = {"duration": duration, "streams": len(stream_results), "long_prompts": len(long_results),
                              "failed": len(failed), "errors": failed[:5]}
    result.update(_stats("itl", itls, [90, 99]))
    result.update(_stats("long_ttft", [r.ttft for r in long_results if r.success], [90, 99]))
    print(f"{len(stream_results)} streams x {args.stream_output_len} tokens, {len(long_results)} prompts of "
          f"{args.long_input_len} tokens every {args.long_interval_s:g} s: streams' ITL p50 "
          f"{result['median_itl_ms']:.1f} ms, p99 {result['p99_itl_ms']:.1f} ms; long prompts' TTFT p50 "
          f"{result['median_long_ttft_ms']:.0f} ms; {len(failed)} failed")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
