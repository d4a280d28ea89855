"""``pagedllm chat``: an interactive conversation on the model's chat template, streamed token by token.

Reads one user message per line: from a terminal with a ``> `` prompt (and line editing), or from piped
stdin without one. ``exit``/``quit``/``/exit`` or Ctrl-D ends the session, ``/reset`` forgets the history,
Ctrl-C stops the reply being generated.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.cli.generate import add_sampling_args, sampling_params_from_args

EXIT_COMMANDS = {"exit", "quit", "/exit", "/quit"}
HELP_TEXT = "Commands: /reset clears the conversation, exit (or Ctrl-D) quits, Ctrl-C stops a reply."


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--system", default=None, help="System prompt that starts the conversation.")
    add_sampling_args(parser, max_tokens=512, temperature=0.7)
    EngineArgs.add_cli_args(parser)
    return parser


def read_user_lines(stdin: TextIO, interactive: bool) -> Iterator[str]:
    """User messages until EOF; ``input()`` on a terminal (readline editing), plain lines otherwise."""
    if interactive:
        try:
            import readline  # noqa: F401  (side effect: arrow keys and history in input())
        except ImportError:
            pass
        while True:
            try:
                yield input("> ")
            except EOFError:
                print()
                return
    else:
        for line in stdin:
            yield line.rstrip("\n")


class ChatSession:
    """The conversation history and one engine; ``reply`` streams the assistant's answer to ``out``."""

    def __init__(self, llm: Any, params: Any, system: str | None = None) -> None:
        self.llm = llm
        self.params = params
        self.system = system
        self.messages: list[dict[str, str]] = []
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_token_ids(self) -> list[int]:
        tok = self.llm.get_tokenizer()
        text = tok.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        # The template already writes BOS/markers; adding special tokens again would double them.
        return tok.encode(text, add_special_tokens=False)

    def reply(self, user_text: str, out: TextIO) -> str:
        from pagedllm.engine.output_processor import OutputKind

        self.messages.append({"role": "user", "content": user_text})
        engine = self.llm.engine
        request_id = f"chat-{next(self._ids)}"
        try:
            engine.add_request(request_id, self.prompt_token_ids(), self.params, kind=OutputKind.DELTA)
        except ValueError:
            self.messages.pop()  # e.g. the history outgrew the context: keep the session usable
            raise
        text, done = "", False
        try:
            while not done and engine.has_unfinished_requests():
                for ro in engine.step():
                    if ro.request_id != request_id:
                        continue
                    delta = ro.outputs[0].text
                    text += delta
                    out.write(delta)
                    out.flush()
                    done = ro.finished
        except KeyboardInterrupt:
            engine.abort_request([request_id])
            out.write(" [stopped]")
        out.write("\n")
        out.flush()
        self.messages.append({"role": "assistant", "content": text})
        return text


def run_chat(session: ChatSession, lines: Iterator[str], out: TextIO, err: TextIO) -> None:
    for line in lines:
        message = line.strip()
        if not message:
            continue
        if message.lower() in EXIT_COMMANDS:
            break
        if message == "/reset":
            session.reset()
            err.write("(conversation cleared)\n")
            continue
        if message in ("/help", "/?"):
            err.write(HELP_TEXT + "\n")
            continue
        try:
            session.reply(message, out)
        except ValueError as e:
            err.write(f"error: {e}\n(use /reset to start a new conversation)\n")


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    params = sampling_params_from_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.disable_log_stats = True  # a periodic stats line would break into the conversation
    llm = LLM(**dataclasses.asdict(engine_args))
    if llm.get_tokenizer().chat_template is None:
        raise ValueError("chat_template: the model has no chat template; pass --chat-template")
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {engine_args.model}. {HELP_TEXT}")
    session = ChatSession(llm, params, args.system)
    try:
        run_chat(session, read_user_lines(sys.stdin, interactive), sys.stdout, sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C at the prompt ends the session quietly
        print()
    return 0
