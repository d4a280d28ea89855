"""``pagedllm generate``: run prompts from the command line (or stdin) and print the outputs.

With ``--stream`` the text is printed as the engine makes it: all prompts run together (continuous
batching) but are printed one after another, the first live and the rest from a buffer when their turn comes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, TextIO

from pagedllm.engine_args import EngineArgs


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128,
                      temperature: float = 1.0) -> None:
    """Sampling flags shared by ``generate`` and ``chat``. The seed is the engine's ``--seed``."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"Most tokens to generate per prompt (default: {max_tokens}).")
    group.add_argument("--temperature", type=float, default=temperature,
                       help=f"Sampling temperature; 0 = greedy (default: {temperature}).")
    group.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: 1.0).")
    group.add_argument("--top-k", type=int, default=0, help="Sample among the k likeliest; 0 = off.")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="Drop tokens below min_p x the top probability; 0 = off.")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 = off.")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="Stop when this text is generated (repeatable).")
    group.add_argument("--ignore-eos", action="store_true", help="Keep generating past the EOS token.")


def sampling_params_from_args(args: argparse.Namespace) -> Any:
    from pagedllm.sampling_params import SamplingParams

    # The engine --seed doubles as the per-request seed, so a run is reproducible whatever is batched with it.
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prompt", "-p", action="append", default=None, metavar="TEXT",
                        help="A prompt (repeatable). Without --prompt, prompts are read from stdin, "
                             "one per line.")
    parser.add_argument("--stream", action="store_true", help="Print tokens as they are generated.")
    parser.add_argument("--chat", action="store_true",
                        help="Wrap each prompt as a user message in the model's chat template.")
    add_sampling_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


def read_prompts(args: argparse.Namespace, stdin: TextIO) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    if stdin.isatty():
        raise ValueError("prompt: give --prompt TEXT (repeatable) or pipe prompts on stdin, one per line")
    prompts = [line.rstrip("\n") for line in stdin if line.strip()]
    if not prompts:
        raise ValueError("prompt: stdin held no prompts")
    return prompts


def _to_engine_prompts(llm: Any, prompts: list[str], chat: bool) -> list[Any]:
    """Text prompts, or chat-templated token ids (the template already holds the special tokens, so
    they are encoded without adding more; token-id prompts go to the engine as they are)."""
    if not chat:
        return list(prompts)
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)
            for p in prompts]


def stream_outputs(llm: Any, prompts: list[Any], params: Any, out: TextIO,
                   labels: list[str] | None = None) -> list[str]:
    """Run all prompts at once; print prompt i's text live when it is the one on screen, else buffer it.

    Returns the full text of each prompt's output.
    """
    from pagedllm.engine.output_processor import OutputKind

    engine = llm.engine
    ids = [f"cli-{i}" for i in range(len(prompts))]
    added: list[str] = []
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params, kind=OutputKind.DELTA)
            added.append(rid)
    except Exception:
        engine.abort_request(added)  # a bad prompt must not leave the others running in the engine
        raise
    texts = [""] * len(prompts)
    finished = [False] * len(prompts)
    index = {rid: i for i, rid in enumerate(ids)}
    shown = 0  # the prompt whose output is on screen

    def header(i: int) -> None:
        if labels:
            out.write(labels[i])
        out.flush()

    header(0)
    try:
        while engine.has_unfinished_requests():
            for ro in engine.step():
                i = index[ro.request_id]
                delta = ro.outputs[0].text
                texts[i] += delta
                if i == shown:
                    out.write(delta)
                    out.flush()
                finished[i] = finished[i] or ro.finished
            # Move on past every finished prompt, printing the buffered text of the next ones.
            while shown < len(prompts) and finished[shown]:
                out.write("\n")
                shown += 1
                if shown < len(prompts):
                    header(shown)
                    out.write(texts[shown])
                    out.flush()
    except BaseException:
        engine.abort_request([rid for rid, done in zip(ids, finished, strict=True) if not done])
        raise
    return texts


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    prompts = read_prompts(args, sys.stdin)
    params = sampling_params_from_args(args)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    engine_prompts = _to_engine_prompts(llm, prompts, args.chat)
    labels = [f"--- prompt {i}: {p!r}\n" for i, p in enumerate(prompts)]
    if args.stream:
        stream_outputs(llm, engine_prompts, params, sys.stdout, labels=labels)
        return 0
    outputs = llm.generate(engine_prompts, params, use_tqdm=len(prompts) > 1)
    for label, output in zip(labels, outputs, strict=True):
        sys.stdout.write(label + output.outputs[0].text + "\n")
    sys.stdout.flush()
    return 0
