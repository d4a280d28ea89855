"""`pagedllm bench structured-output`: the cost of structured outputs, measured side by side in one process.

1. Throughput: ``--num-prompts`` chat requests, each under a JSON schema, then the same requests free with
   the same output lengths (EOS ignored), then both again (interleaved, so a noisy machine hurts both
   alike); output tokens per second of each and the overhead. The schema requests end by themselves at
   different lengths, and the free twins end at exactly those lengths, so both arms run the same number of
   steps at the same batch sizes; each arm's token count and step count are reported so this can be checked.
2. Per-step time at equal batch size: the median engine step while every request is decoding (no prefill
   in the step, the full batch running) in each arm, and their ratio: the grammar's cost per step,
   without the tail of the run where few requests are left.
3. Time to first token for a schema never seen (compile + first step) and for the same schema again (cached).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

from pagedllm.engine_args import EngineArgs
from pagedllm.logger import init_logger

logger = init_logger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"enum": ["friend", "family", "work", "other"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"]},
    },
    "required": ["name", "age", "city", "tags", "address"],
}
TOPICS = ["a teacher", "a pilot", "a baker", "a painter", "a nurse", "a farmer", "a chef", "a writer"]


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-prompts", type=int, default=64, help="Chat requests per run.")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens per request.")
    parser.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature.")
    parser.add_argument("--repeats", type=int, default=2, help="Interleaved (schema, free) run pairs.")
    parser.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    EngineArgs.add_cli_args(parser)
    return parser


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as JSON with "
                                                "name, age, city, tags and address."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


class StepTimer:
    """Times every engine step of an LLM and records its batch: (requests, tokens scheduled, seconds)."""

    def __init__(self, llm: Any) -> None:
        self.steps: list[tuple[int, int, float]] = []
        core = llm.engine.core
        step, schedule = core.step, core.scheduler.schedule
        scheduled: list[Any] = [None]

        def timed_schedule():
            scheduled[0] = schedule()
            return scheduled[0]

        def timed_step():
            start = time.perf_counter()
            out = step()
            sched = scheduled[0]
            if sched is not None and not sched.is_empty:
                self.steps.append((len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens,
                                   time.perf_counter() - start))
            return out

        core.scheduler.schedule, core.step = timed_schedule, timed_step

    def summary(self) -> dict:
        """Step count, mean step time, and the median of the decode-only steps (one token per request) at
        the largest batch the run reached (``--max-num-seqs`` may cap it below ``--num-prompts``)."""
        decode = [(reqs, t) for reqs, tokens, t in self.steps if reqs == tokens]
        full_batch = max((reqs for reqs, _ in decode), default=0)
        full = [t for reqs, t in decode if reqs == full_batch]
        return {"steps": len(self.steps),
                "mean_step_ms": 1000 * statistics.fmean(t for _, _, t in self.steps) if self.steps else None,
                "full_batch": full_batch, "full_batch_decode_steps": len(full),
                "full_batch_decode_step_ms": 1000 * statistics.median(full) if full else None}


def _throughput(llm, prompts, params, timer: StepTimer) -> tuple[dict, list[int]]:
    timer.steps.clear()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    ended = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    return ({"elapsed_s": elapsed, "output_tokens": sum(lengths), "output_tokens_per_s": sum(lengths) / elapsed,
             "requests_per_s": len(prompts) / elapsed, "self_terminated": ended,
             **timer.summary()}, lengths)


def _ttft(llm, prompt, schema) -> float:
    """Wall time of a 1-token request: validation/compile + scheduling + the prefill step."""
    from pagedllm import SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    prompts = _prompts(llm.get_tokenizer(), args.num_prompts)
    constrained = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate([{"prompt_token_ids": prompts[0]}], constrained, use_tqdm=False)  # warm-up, compiles SCHEMA
    timer = StepTimer(llm)
    runs: dict[str, list[dict]] = {"json_schema": [], "free": []}
    for _ in range(args.repeats):
        result, lengths = _throughput(llm, prompts, constrained, timer)
        runs["json_schema"].append(result)
        # The free twin of each request generates exactly as many tokens (EOS ignored), so both runs do
        # the same work but for the grammar: the elapsed-time ratio is its overhead.
        free = [SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=n, ignore_eos=True)
                for n in lengths]
        runs["free"].append(_throughput(llm, prompts, free, timer)[0])
        for name in runs:
            r = runs[name][-1]
            logger.info("%s: %d output tokens in %d steps, %.1f tok/s, full-batch decode step %s ms", name,
                        r["output_tokens"], r["steps"], r["output_tokens_per_s"],
                        f"{r['full_batch_decode_step_ms']:.2f}" if r["full_batch_decode_step_ms"] else "n/a")

    def best(name: str, key: str = "output_tokens_per_s") -> float:
        return max(r[key] for r in runs[name])

    def fastest_step(name: str) -> float | None:
        steps = [r["full_batch_decode_step_ms"] for r in runs[name] if r["full_batch_decode_step_ms"]]
        return min(steps) if steps else None

    step_schema, step_free = fastest_step("json_schema"), fastest_step("free")

    # A schema never seen before: a fresh property name makes a new cache key.
    fresh = json.loads(json.dumps(SCHEMA))
    fresh["properties"][f"id_{uuid.uuid4().hex[:8]}"] = {"type": "integer"}
    ttft_new = _ttft(llm, prompts[0], fresh)
    ttft_cached = _ttft(llm, prompts[0], fresh)
    result = {
        "runs": runs,
        "json_schema_output_tokens_per_s": best("json_schema"),
        "free_output_tokens_per_s": best("free"),
        "overhead": 1.0 - best("json_schema") / best("free"),
        "json_schema_output_tokens": [r["output_tokens"] for r in runs["json_schema"]],
        "free_output_tokens": [r["output_tokens"] for r in runs["free"]],
        "json_schema_steps": [r["steps"] for r in runs["json_schema"]],
        "free_steps": [r["steps"] for r in runs["free"]],
        "json_schema_full_batch_decode_step_ms": step_schema,
        "free_full_batch_decode_step_ms": step_free,
        "step_overhead": step_schema / step_free - 1.0 if step_schema and step_free else None,
        "ttft_new_schema_s": ttft_new,
        "ttft_cached_schema_s": ttft_cached,
        "settings": {k: getattr(args, k) for k in ("num_prompts", "output_len", "temperature", "repeats")},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
