"""Offline throughput: ``pagedllm bench throughput``.

Runs the same random token-id prompts through pagedllm's ``LLM.generate`` (continuous batching) or
through Hugging Face ``generate()`` with static batches, and reports vLLM's JSON keys
(``elapsed_time``, ``num_requests``, ``total_num_tokens``, ``requests_per_second``, ``tokens_per_second``)
plus output tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from tqdm.auto import tqdm

from pagedllm.benchmarks.datasets import SampledRequest, add_dataset_args, random_requests
from pagedllm.benchmarks.grounded import grounded_requests
from pagedllm.benchmarks.lora_adapters import add_lora_bench_args, random_adapters, spread, with_lora
from pagedllm.engine_args import EngineArgs
from pagedllm.utils import gc_heap_frozen


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--backend", choices=["pagedllm", "hf"], default="pagedllm",
                        help="pagedllm: this engine. hf: Hugging Face generate() with static batches on the "
                             "same prompts (default: pagedllm).")
    parser.add_argument("--hf-batch-sizes", default="8,32",
                        help="Comma-separated static batch sizes for --backend hf; the best is reported "
                             "(default: 8,32).")
    parser.add_argument("--dataset", choices=["random", "grounded"], default="random",
                        help="random token ids, or grounded prompts asking to repeat a passage (see "
                             "pagedllm/benchmarks/grounded.py; where speculative decoding pays).")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="Skip the short untimed warm-up generation.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    add_dataset_args(parser)
    add_lora_bench_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


def _summary(requests: list[SampledRequest], num_output_tokens: int, elapsed: float) -> dict[str, Any]:
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    total = num_prompt_tokens + num_output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total,
        "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": num_output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
    }


def run_pagedllm(requests: list[SampledRequest], llm: Any, warmup: bool = True,
                 use_tqdm: bool = True, loras: list | None = None) -> dict[str, Any]:
    """``loras``: each request's LoRA adapter (``--num-lora-adapters``), or None for the base model."""
    from pagedllm import SamplingParams

    # Same settings as vLLM's benchmark: plain sampling at temperature 1, every request runs to output_len.
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    if warmup:  # first forward passes pay one-off allocation costs; keep them out of the timing
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                     lora_request=loras[:1] if loras else None)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=loras)
    elapsed = time.perf_counter() - start
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = _summary(requests, num_output_tokens, elapsed)
    result["dtype"] = llm.engine.config.model.dtype
    result["num_kv_blocks"] = llm.engine.config.cache.num_blocks
    return result


def _load_hf_model(engine_args: EngineArgs) -> tuple[Any, Any, Any]:
    """The same model files pagedllm resolves, loaded by transformers at pagedllm's resolved dtype."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    config = engine_args.create_engine_config()  # resolves the model and dtype without loading weights
    mc = config.model
    dtype = getattr(torch, mc.dtype)
    start = time.perf_counter()
    if mc.gguf_file:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(mc.gguf_file),
                                                     gguf_file=os.path.basename(mc.gguf_file),
                                                     torch_dtype=dtype, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(mc.model_path, torch_dtype=dtype, local_files_only=True,
                                                     trust_remote_code=mc.trust_remote_code)
    from pagedllm.worker.worker import resolve_device

    model = model.to(dtype).to(resolve_device(config.device.device)).eval()
    print(f"HF model loaded in {time.perf_counter() - start:.1f} s ({mc.dtype}, {model.device})")
    return model, mc, dtype


def run_hf(requests: list[SampledRequest], engine_args: EngineArgs, batch_sizes: list[int],
           warmup: bool = True, use_tqdm: bool = True) -> dict[str, Any]:
    import torch

    model, mc, _ = _load_hf_model(engine_args)
    eos = mc.eos_token_ids[0] if mc.eos_token_ids else 0
    pad_id = getattr(model.generation_config, "pad_token_id", None)
    pad_id = pad_id if isinstance(pad_id, int) else eos
    torch.manual_seed(engine_args.seed)

    def generate(batch: list[SampledRequest]) -> int:
        # Left padding keeps every prompt's last token at the end, where generation continues.
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        out_len = max(r.expected_output_len for r in batch)
        ids, mask = ids.to(model.device), mask.to(model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=out_len, min_new_tokens=out_len,
                             pad_token_id=pad_id)
        return (out.shape[1] - width) * len(batch)

    per_batch_size: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        if warmup:
            generate([dataclasses.replace(requests[0], expected_output_len=2)])
        for bs in batch_sizes:
            batches = [requests[i:i + bs] for i in range(0, len(requests), bs)]
            num_output_tokens = 0
            start = time.perf_counter()
            for batch in tqdm(batches, desc=f"HF generate (batch {bs})", disable=not use_tqdm,
                              dynamic_ncols=True):
                num_output_tokens += generate(batch)
            elapsed = time.perf_counter() - start
            per_batch_size[str(bs)] = _summary(requests, num_output_tokens, elapsed)
            print(f"  batch {bs}: {per_batch_size[str(bs)]['output_tokens_per_second']:.1f} output tok/s")
    best_bs = max(per_batch_size, key=lambda k: per_batch_size[k]["tokens_per_second"])
    result = dict(per_batch_size[best_bs])
    result.update(best_batch_size=int(best_bs), per_batch_size=per_batch_size, dtype=mc.dtype)
    return result


def _parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise ValueError(f"hf_batch_sizes: expected comma-separated integers, got {text!r}") from e
    if not sizes or min(sizes) < 1:
        raise ValueError(f"hf_batch_sizes: expected positive integers, got {text!r}")
    return sizes


def main(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = with_lora(EngineArgs.from_cli_args(args), args)
    use_tqdm = not args.disable_tqdm

    def make_requests(tokenizer: Any) -> list[SampledRequest]:
        # Same tokenizer, seed and lengths for both backends, so both see identical token ids.
        if getattr(args, "dataset", "random") == "grounded":
            return grounded_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, seed=args.seed)
        return random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                               prefix_len=args.prefix_len, seed=args.seed, num_prefixes=args.num_prefixes)

    if args.backend == "hf" and args.num_lora_adapters > 0:
        raise ValueError("num_lora_adapters: the hf backend runs the base model only")
    if args.backend == "hf":
        from pagedllm.model_executor.loader import load_tokenizer

        batch_sizes = _parse_batch_sizes(args.hf_batch_sizes)
        requests = make_requests(load_tokenizer(engine_args.create_engine_config().model))
        result = run_hf(requests, engine_args, batch_sizes, args.warmup, use_tqdm)
    else:
        from pagedllm import LLM

        llm = LLM(**dataclasses.asdict(engine_args))
        requests = make_requests(llm.get_tokenizer())
        adapters = (random_adapters(llm.engine.config.model.hf_config, args.num_lora_adapters, args.lora_rank,
                                    args.seed) if args.num_lora_adapters > 0 else [])
        with gc_heap_frozen():  # as in a served engine's core process
            result = run_pagedllm(requests, llm, args.warmup, use_tqdm, spread(adapters, len(requests)))
        result.update(num_lora_adapters=len(adapters), lora_rank=args.lora_rank if adapters else None,
                      max_loras=engine_args.max_loras if adapters else None)
    result.update(
        backend=args.backend, model=engine_args.model, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len, seed=args.seed,
        kv_cache_memory=engine_args.kv_cache_memory, max_num_seqs=engine_args.max_num_seqs,
        max_num_batched_tokens=engine_args.max_num_batched_tokens,
        enable_prefix_caching=engine_args.enable_prefix_caching)
    print(f"Throughput ({args.backend}): {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s "
          f"({result['num_requests']} requests, {result['elapsed_time']:.2f} s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
