"""Latency of one batch: ``pagedllm bench latency``.

Times ``LLM.generate`` on one batch of ``--batch-size`` random prompts, ``--num-iters`` times after
``--num-iters-warmup`` untimed runs, and reports the average, percentiles, time to first token and
milliseconds per output token. Keys ``avg_latency``, ``latencies`` and ``percentiles`` follow vLLM's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pagedllm.benchmarks.datasets import random_requests
from pagedllm.benchmarks.grounded import grounded_requests
from pagedllm.benchmarks.lora_adapters import add_lora_bench_args, random_adapters, spread, with_lora
from pagedllm.engine_args import EngineArgs
from pagedllm.utils import gc_heap_frozen

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("latency benchmark")
    group.add_argument("--input-len", type=int, default=128, help="Prompt tokens (default: 128).")
    group.add_argument("--output-len", type=int, default=128,
                       help="Generated tokens, EOS ignored (default: 128).")
    group.add_argument("--batch-size", type=int, default=1, help="Prompts in the batch (default: 1).")
    group.add_argument("--num-iters", type=int, default=5, help="Timed iterations (default: 5).")
    group.add_argument("--num-iters-warmup", type=int, default=1,
                       help="Untimed warm-up iterations (default: 1).")
    group.add_argument("--dataset", choices=["random", "grounded"], default="random",
                       help="random: random token ids; grounded: prompts asking to repeat a passage of about "
                            "--input-len tokens (where speculative decoding pays; pagedllm/benchmarks/grounded.py).")
    group.add_argument("--temperature", type=float, default=1.0,
                       help="Sampling temperature (default: 1.0, as vLLM's benchmark; 0 = greedy).")
    group.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    add_lora_bench_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


def summarize(latencies: list[float], ttfts: list[float], output_len: int) -> dict[str, Any]:
    """Latencies and TTFTs in seconds (one per iteration) → the report, times in s and ms."""
    lat = np.asarray(latencies, dtype=np.float64)
    ttft = np.asarray(ttfts, dtype=np.float64)
    avg = float(lat.mean())
    # Decode time per token excludes the first token, which carries the whole prefill.
    decode_per_token = (lat - ttft) / max(output_len - 1, 1)
    return {
        "avg_latency": avg,
        "latencies": lat.tolist(),
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in PERCENTILES},
        "avg_ttft_ms": float(ttft.mean() * 1000),
        "median_ttft_ms": float(np.median(ttft) * 1000),
        "ms_per_output_token": avg * 1000 / output_len,
        "avg_tpot_ms": float(decode_per_token.mean() * 1000),
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    if args.num_iters < 1 or args.num_iters_warmup < 0 or args.batch_size < 1:
        raise ValueError("num_iters and batch_size must be >= 1 and num_iters_warmup >= 0")
    engine_args = with_lora(EngineArgs.from_cli_args(args), args)
    llm = LLM(**dataclasses.asdict(engine_args))
    adapters = (random_adapters(llm.engine.config.model.hf_config, args.num_lora_adapters, args.lora_rank, args.seed)
                if getattr(args, "num_lora_adapters", 0) > 0 else [])
    make = grounded_requests if getattr(args, "dataset", "random") == "grounded" else random_requests
    requests = make(llm.get_tokenizer(), args.batch_size, args.input_len, args.output_len, seed=args.seed)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(temperature=getattr(args, "temperature", 1.0), top_p=1.0, ignore_eos=True,
                            max_tokens=args.output_len)

    def run_once() -> tuple[float, float]:
        # Prefix caching would turn every iteration after the first into a cache hit; start cold each time.
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=spread(adapters, len(prompts)))
        latency = time.perf_counter() - start
        ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics and o.metrics.first_token_time]
        # Batch TTFT: when the last request of the batch got its first token.
        return latency, max(ttfts) if ttfts else float("nan")

    latencies, ttfts = [], []
    with gc_heap_frozen():  # as in a served engine's core process
        for _ in tqdm(range(args.num_iters_warmup), desc="Warm-up", disable=args.disable_tqdm):
            run_once()
        for _ in tqdm(range(args.num_iters), desc="Profiling", disable=args.disable_tqdm):
            latency, ttft = run_once()
            latencies.append(latency)
            ttfts.append(ttft)
    result = summarize(latencies, ttfts, args.output_len)
    stats = llm.engine.core.scheduler.spec_stats
    result.update(speculative_config=engine_args.speculative_config, dataset=getattr(args, "dataset", "random"),
                  mean_acceptance_length=stats.mean_acceptance_length)
    result.update(model=engine_args.model, dtype=llm.engine.config.model.dtype, batch_size=args.batch_size,
                  input_len=args.input_len, output_len=args.output_len, num_iters=args.num_iters,
                  num_iters_warmup=args.num_iters_warmup)
    print(f"Avg latency: {result['avg_latency']:.4f} s  (batch {args.batch_size}, "
          f"{args.input_len} in / {args.output_len} out)")
    for p, v in result["percentiles"].items():
        print(f"  {p}% percentile latency: {v:.4f} s")
    if stats.num_drafts:
        print(f"Speculative decoding: mean acceptance length {stats.mean_acceptance_length:.2f} tokens per step")
    print(f"TTFT: {result['avg_ttft_ms']:.1f} ms avg; "
          f"{result['ms_per_output_token']:.2f} ms per output token "
          f"({result['avg_tpot_ms']:.2f} ms per decode step)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
