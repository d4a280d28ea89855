"""Host time per engine step: the Python every device pays (scheduler, input preparation, sampling metadata,
output processing), measured on a model so small that its compute is negligible beside it.

On a GPU a decode step's kernels take a millisecond or two, so this host work decides how many steps a second
the engine can issue at large batches. It is the same code on every device, so it is measured here on the CPU:
the default model's tokenizer and vocabulary, with a random 2-layer, 64-wide body. Each piece is timed by
wrapping its function; ``step`` is the whole engine step (model included).

    python benchmarks/host_overhead.py --batch-sizes 1,64,512 --output-json results/host_overhead.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PIECES = {  # label: (module, class or None, function)
    "schedule": ("pagedllm.core.scheduler", "Scheduler", "schedule"),
    "update_states": ("pagedllm.worker.model_runner", "ModelRunner", "_update_states"),
    "prepare_inputs": ("pagedllm.worker.model_runner", "ModelRunner", "_prepare_inputs"),
    "sampling_metadata": ("pagedllm.sample.batch_state", "SamplingBatch", "metadata"),
    "update_from_output": ("pagedllm.core.scheduler", "Scheduler", "update_from_output"),
    "process_outputs": ("pagedllm.engine.output_processor", "OutputProcessor", "process_outputs"),
    "step": ("pagedllm.engine.llm_engine", "LLMEngine", "step"),
}


def tiny_default_model(folder: Path) -> Path:
    """The default model's config and tokenizer around a random 2-layer, 64-wide body, as an HF folder."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from pagedllm.model_executor.loader.model_source import find_model_source

    source = find_model_source(None)
    gguf = Path(source.gguf_file).name
    config = AutoConfig.from_pretrained(source.folder, gguf_file=gguf)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source.folder, gguf_file=gguf).save_pretrained(folder)
    return folder


def instrument() -> dict[str, float]:
    """Wrap each piece with a timer; returns the dict the seconds accumulate in."""
    import importlib

    seconds: dict[str, float] = defaultdict(float)
    for label, (module_name, owner_name, name) in PIECES.items():
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        fn = getattr(owner, name)

        def timed(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - start

        setattr(owner, name, functools.wraps(fn)(timed))
    return seconds


def run(model: Path, batch: int, input_len: int, output_len: int, repeats: int, seconds: dict[str, float],
        sampling: str = "greedy") -> dict:
    """Milliseconds per step of each piece for ``batch`` requests at once (the best of ``repeats`` runs).

    ``sampling``: "greedy", or "random" (temperature 0.8, top-k 50, top-p 0.95, a presence penalty and a seed
    per request: every sampler stage with per-request state is active)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=str(model), max_num_seqs=batch, max_num_batched_tokens=max(8192, batch * input_len),
              dtype="float32", disable_log_stats=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(input_len)]} for _ in range(batch)]
    if sampling == "greedy":
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    else:
        params = [SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.95,
                                 presence_penalty=0.5, seed=i) for i in range(batch)]
    llm.generate(prompts[:2], params if sampling == "greedy" else params[:2], use_tqdm=False)
    best: dict | None = None
    for _ in range(repeats):
        seconds.clear()
        steps_before = llm.engine.core.num_steps
        llm.generate(prompts, params, use_tqdm=False)
        steps = llm.engine.core.num_steps - steps_before
        row = {label: round(seconds[label] / steps * 1e3, 3) for label in PIECES}
        row["host_pieces"] = round(sum(v for k, v in row.items() if k != "step"), 3)
        if best is None or row["host_pieces"] < best["host_pieces"]:
            best = dict(batch=batch, sampling=sampling, steps=steps, **row)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,64,512", help="Comma-separated batch sizes (default 1,64,512).")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="Runs per batch size; the fastest is kept.")
    parser.add_argument("--sampling", choices=["greedy", "random"], default="greedy",
                        help="greedy, or random sampling with top-k, top-p, a presence penalty and a seed per request.")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    seconds = instrument()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_default_model(Path(tmp))
        rows = [run(model, int(b), args.input_len, args.output_len, args.repeats, seconds, args.sampling)
                for b in args.batch_sizes.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
