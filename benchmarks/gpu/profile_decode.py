"""Share of a decode step the device is busy, from the torch profiler.

    python benchmarks/gpu/profile_decode.py MODEL --batch-size 1 --steps 40 --output-json out.json

Runs ``batch-size`` prompts of 16 tokens to completion of ``steps`` tokens each with greedy sampling, and
profiles the decode steps: busy share = sum of device kernel time / wall time; also kernel launches per step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              kv_cache_memory="2GiB")
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    prompts = [{"prompt_token_ids": [10 + i] * 16} for i in range(args.batch_size)]
    llm.generate(prompts, params)  # warm-up: compiles kernels, fills allocator caches
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in device_events)
    result = {
        "batch_size": args.batch_size, "steps": args.steps, "wall_s": wall,
        "device_busy_share": busy_us / 1e6 / wall if wall else 0.0,
        "device_kernels_per_step": len(device_events) / args.steps,
        "note": "profiler overhead inflates wall time; compare shares, not absolute times",
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
