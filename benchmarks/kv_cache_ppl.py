"""Perplexity of one model on a fixed text (~2,000 tokens of standard-library docstrings) with each KV cache dtype:
what an fp8 cache costs in quality against the model's own (auto) cache.

    PYTHONPATH=. python benchmarks/kv_cache_ppl.py --model /tmp/fb-smollm2-bf16 --dtype bfloat16 \
        --kv-cache-dtypes auto fp8 fp8_e5m2

Prints one JSON line per dtype: {"kv_cache_dtype", "perplexity", "vs_first"} (vs_first: relative to the first
dtype listed)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gc
import json
import logging
import math
import os
import pathlib
import re
import string
import typing
import unittest

from pagedllm import LLM, SamplingParams

_MODULES = (argparse, json, logging, unittest, re, pathlib, typing, os, functools, dataclasses, string, collections)


def text_ids(llm: LLM, max_tokens: int) -> list[int]:
    text = "\n\n".join((m.__doc__ or "").strip() for m in _MODULES)
    return llm.get_tokenizer().encode(text)[:max_tokens]


def perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = -sum(entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True))
    return math.exp(nll / (len(ids) - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"])
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--calculate-kv-scales", action="store_true", help="fp8 caches: scales from the first step")
    args = parser.parse_args()
    first = None
    for kv_dtype in args.kv_cache_dtypes:
        kw = {} if args.model is None else {"model": args.model}
        fp8 = kv_dtype.startswith("fp8")
        llm = LLM(dtype=args.dtype, kv_cache_dtype=kv_dtype, kv_cache_memory="256MiB", max_num_batched_tokens=512,
                  enable_prefix_caching=False, calculate_kv_scales=fp8 and args.calculate_kv_scales, **kw)
        ppl = perplexity(llm, text_ids(llm, args.max_tokens))
        first = first or ppl
        print(json.dumps({"kv_cache_dtype": kv_dtype, "perplexity": round(ppl, 4),
                          "vs_first": f"{100 * (ppl / first - 1):+.2f}%"}), flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
