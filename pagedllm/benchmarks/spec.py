"""Speculative decoding on chat workloads, side by side: ``pagedllm bench spec``.

One engine per method (``off``, ``ngram``, ``suffix``, or any JSON speculative config) in this process, the same
conversations (``spec_workloads.py``) through each, rounds alternating between the engines so that a noisy
moment of the machine does not land on one method. Reports per workload and method the milliseconds per output
token (all of a turn's time, prompt included, over its output tokens), the speed-up against ``off``, and the mean
acceptance length. Greedy, so every method gives the same answers (checked). The timed rounds run with the
collector's heap frozen, as a served engine's core process runs (``utils.freeze_gc_heap``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from tqdm.auto import tqdm

from pagedllm.benchmarks.spec_workloads import WORKLOADS, conversations
from pagedllm.engine_args import EngineArgs
from pagedllm.utils import gc_heap_frozen

METHODS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("speculative decoding benchmark")
    group.add_argument("--workloads", default=",".join(WORKLOADS),
                       help=f"Comma-separated, of {', '.join(WORKLOADS)} (default: all).")
    group.add_argument("--methods", default=",".join(METHODS),
                       help="Comma-separated: off, ngram, suffix (their configs: pagedllm/benchmarks/spec.py) or "
                            "name=JSON speculative config (default: off,ngram,suffix).")
    group.add_argument("--num-conversations", type=int, default=4, help="Conversations per workload (default 4).")
    group.add_argument("--concurrency", type=int, default=1,
                       help="Conversations in flight together (default 1: one request at a time).")
    group.add_argument("--output-len", type=int, default=128, help="Max tokens per answer (default 128).")
    group.add_argument("--rounds", type=int, default=2, help="Timed rounds, alternating methods (default 2).")
    group.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    EngineArgs.add_cli_args(parser)
    return parser


def _methods(spec: str) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec + ","):  # commas inside a JSON config do not split
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    for item in items:
        name, _, config = item.partition("=")
        if config:
            out[name] = json.loads(config)
        elif name in METHODS:
            out[name] = METHODS[name]
        else:
            raise ValueError(f"--methods: {name!r} is not one of {sorted(METHODS)} and has no =JSON config")
    return out


def _accepted(llm: Any) -> tuple[int, int]:
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return values["vllm:spec_decode_num_drafts"], values["vllm:spec_decode_num_accepted_tokens"]


def run_workload(llm: Any, convs: list, concurrency: int, params: Any) -> tuple[float, int, list[list[str]]]:
    """Every conversation turn by turn, ``concurrency`` conversations together; (seconds, output tokens, answers)."""
    seconds, tokens, answers = 0.0, 0, []
    for at in range(0, len(convs), concurrency):
        group = convs[at:at + concurrency]
        said: list[list[str]] = [[] for _ in group]
        for turn in range(max(len(c.turns) for c in group)):
            live = [i for i, c in enumerate(group) if turn < len(c.turns)]
            start = time.perf_counter()
            outs = llm.chat([group[i].messages(said[i]) for i in live], params, use_tqdm=False)
            seconds += time.perf_counter() - start
            for i, out in zip(live, outs):
                said[i].append(out.outputs[0].text)
                tokens += len(out.outputs[0].token_ids)
        answers += said
    return seconds, tokens, answers


def main(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    methods = _methods(args.methods)
    workloads = args.workloads.split(",")
    engine_args = EngineArgs.from_cli_args(args)
    llms = {}
    for name, config in methods.items():
        kwargs = dataclasses.asdict(engine_args)
        kwargs["speculative_config"] = config
        llms[name] = LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    convs = {w: conversations(w, args.num_conversations, seed=args.seed or 0) for w in workloads}
    totals: dict[tuple[str, str], list[float]] = {(w, m): [0.0, 0, 0, 0] for w in workloads for m in methods}
    answers: dict[tuple[str, str], list] = {}
    for llm in llms.values():  # warm-up: the first requests of an engine pay one-time costs
        run_workload(llm, conversations("repeat", 1, seed=99), 1, SamplingParams(temperature=0, max_tokens=16))
    steps = [(r, w, m) for r in range(args.rounds) for w in workloads for m in methods]
    with gc_heap_frozen():  # as in a served engine's core process
        for _, workload, name in tqdm(steps, desc="Rounds", disable=args.disable_tqdm):
            llm = llms[name]
            drafts0, accepted0 = _accepted(llm)
            seconds, tokens, said = run_workload(llm, convs[workload], args.concurrency, params)
            drafts1, accepted1 = _accepted(llm)
            total = totals[workload, name]
            total[0] += seconds
            total[1] += tokens
            total[2] += drafts1 - drafts0
            total[3] += accepted1 - accepted0
            answers.setdefault((workload, name), said)
    results: dict[str, Any] = {"concurrency": args.concurrency, "num_conversations": args.num_conversations,
                               "output_len": args.output_len, "rounds": args.rounds, "model": engine_args.model,
                               "methods": {n: c for n, c in methods.items()}, "workloads": {}}
    print(f"{'workload':14s} {'method':10s} {'ms/token':>9s} {'speed-up':>9s} {'accept len':>10s} {'same text':>9s}")
    for workload in workloads:
        rows = {}
        base = totals[workload, next(iter(methods))]
        base_ms = 1000 * base[0] / max(base[1], 1)
        for name in methods:
            seconds, tokens, drafts, accepted = totals[workload, name]
            ms = 1000 * seconds / max(tokens, 1)
            accept_len = 1 + accepted / drafts if drafts else 0.0
            same = answers[workload, name] == answers[workload, next(iter(methods))]
            rows[name] = {"ms_per_output_token": ms, "speedup": base_ms / ms, "mean_acceptance_length": accept_len,
                          "output_tokens": int(tokens), "same_text_as_first_method": same}
            print(f"{workload:14s} {name:10s} {ms:9.2f} {base_ms / ms:8.2f}x {accept_len:10.2f} {str(same):>9s}")
        results["workloads"][workload] = rows
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results
