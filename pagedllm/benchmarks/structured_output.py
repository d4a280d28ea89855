"""`pagedllm bench structured-output`: the cost of structured outputs, measured side by side in one process.

1. Throughput: ``--num-prompts`` chat requests, each under a JSON schema, then the same requests free with
   the same output lengths (EOS ignored), then both again (interleaved, so a noisy machine hurts both
   alike); output tokens per second of each and the overhead.
2. Time to first token for a schema never seen (compile + first step) and for the same schema again (cached).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

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


def _throughput(llm, prompts, params) -> tuple[dict, list[int]]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    ended = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    return ({"elapsed_s": elapsed, "output_tokens": sum(lengths), "output_tokens_per_s": sum(lengths) / elapsed,
             "requests_per_s": len(prompts) / elapsed, "self_terminated": ended}, lengths)


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
    runs: dict[str, list[dict]] = {"json_schema": [], "free": []}
    for _ in range(args.repeats):
        result, lengths = _throughput(llm, prompts, constrained)
        runs["json_schema"].append(result)
        # The free twin of each request generates exactly as many tokens (EOS ignored), so both runs do
        # the same work but for the grammar: the elapsed-time ratio is its overhead.
        free = [SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=n, ignore_eos=True)
                for n in lengths]
        runs["free"].append(_throughput(llm, prompts, free)[0])

    def best(name: str) -> float:
        return max(r["output_tokens_per_s"] for r in runs[name])

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
        "ttft_new_schema_s": ttft_new,
        "ttft_cached_schema_s": ttft_cached,
        "settings": {k: getattr(args, k) for k in ("num_prompts", "output_len", "temperature", "repeats")},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
