"""`pagedllm bench prefix-caching`: a shared-prefix workload with prefix caching on, then off.

Workload (as in the prefix-caching issue): ``--num-docs`` documents of ``--doc-len`` random tokens, each
asked ``--questions-per-doc`` questions of ``--question-len`` tokens, ``--output-len`` tokens per answer.
Both runs happen in this process, on the same prompts, so their ratio is meaningful on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from pagedllm.benchmarks.datasets import allowed_token_ids
from pagedllm.engine_args import EngineArgs
from pagedllm.logger import init_logger

logger = init_logger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-docs", type=int, default=8, help="Distinct shared prefixes (documents).")
    parser.add_argument("--doc-len", type=int, default=1024, help="Tokens per document.")
    parser.add_argument("--questions-per-doc", type=int, default=8, help="Requests per document.")
    parser.add_argument("--question-len", type=int, default=32, help="Tokens per question (after the doc).")
    parser.add_argument("--output-len", type=int, default=32, help="Tokens generated per request.")
    parser.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    EngineArgs.add_cli_args(parser)  # its --seed also seeds the random prompts
    return parser


def make_prompts(tokenizer: Any, num_docs: int, doc_len: int, questions: int, question_len: int,
                 seed: int) -> list[list[int]]:
    """Prompts interleaved across documents (doc 0 q0, doc 1 q0, ...), as independent users would send."""
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    docs = [rng.choice(vocab, size=doc_len).tolist() for _ in range(num_docs)]
    return [docs[d] + rng.choice(vocab, size=question_len).tolist()
            for _ in range(questions) for d in range(num_docs)]


def _run(prompts: list[list[int]], output_len: int, args: argparse.Namespace, caching: bool) -> dict:
    from pagedllm import LLM, SamplingParams

    kwargs = {k: v for k, v in vars(EngineArgs.from_cli_args(args)).items()}
    kwargs["enable_prefix_caching"] = caching
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    kv = llm.engine.core.scheduler.kv
    q0, h0 = kv.prefix_cache_queries, kv.prefix_cache_hits
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    queries, hits = kv.prefix_cache_queries - q0, kv.prefix_cache_hits - h0
    return {"prefix_caching": caching, "elapsed_time": elapsed, "mean_ttft_s": float(np.mean(ttfts)),
            "num_requests": len(prompts), "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "output_token_ids": [o.outputs[0].token_ids for o in outs]}


def main(args: argparse.Namespace) -> dict:
    from pagedllm.model_executor.loader import load_tokenizer, resolve_model_config

    config = EngineArgs.from_cli_args(args).create_engine_config()
    tokenizer = load_tokenizer(resolve_model_config(config.model))
    prompts = make_prompts(tokenizer, args.num_docs, args.doc_len, args.questions_per_doc, args.question_len,
                           args.seed)
    on = _run(prompts, args.output_len, args, caching=True)
    off = _run(prompts, args.output_len, args, caching=False)
    same = on.pop("output_token_ids") == off.pop("output_token_ids")
    result = {"on": on, "off": off, "speedup": off["elapsed_time"] / on["elapsed_time"],
              "ttft_speedup": off["mean_ttft_s"] / on["mean_ttft_s"], "identical_greedy_outputs": same,
              "settings": {k: getattr(args, k) for k in ("num_docs", "doc_len", "questions_per_doc",
                                                         "question_len", "output_len")}}
    print(f"prefix caching on : {on['elapsed_time']:.1f} s, mean TTFT {on['mean_ttft_s']:.2f} s, "
          f"hit rate {on['hit_rate']:.1%}")
    print(f"prefix caching off: {off['elapsed_time']:.1f} s, mean TTFT {off['mean_ttft_s']:.2f} s")
    print(f"speed-up {result['speedup']:.2f}x end to end, {result['ttft_speedup']:.2f}x mean TTFT; "
          f"greedy outputs identical: {same}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
