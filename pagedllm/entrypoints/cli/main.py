"""The ``pagedllm`` command: ``serve``, ``proxy``, ``generate``, ``chat``, ``transcribe`` and ``bench ...``.

Subcommand modules are imported only when their parser is built or run, so ``pagedllm --help`` stays quick
and a missing optional piece (the HTTP server) breaks only its own subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

Handler = Callable[[argparse.Namespace], Any]

class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless the help already states it or it is an unset/boolean flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default in (None, False, True, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action) or ""


_FORMATTER = _Formatter


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:  # running from a source tree that was never pip-installed
        from pagedllm import __version__

        return __version__


def _unavailable(command: str, error: BaseException) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        print(f"pagedllm {command}: not available in this installation ({type(error).__name__}: {error})",
              file=sys.stderr)
        return 1
    return handler


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    """``serve`` comes from ``pagedllm.entrypoints.cli.serve`` (``add_serve_parser``, ``run_serve``)."""
    help_text = "Start the OpenAI-compatible HTTP server."
    try:
        module = importlib.import_module("pagedllm.entrypoints.cli.serve")
        add_serve_parser, run_serve = module.add_serve_parser, module.run_serve
    except (ImportError, AttributeError) as e:
        parser = subparsers.add_parser("serve", help=help_text + " (unavailable)",
                                       description=f"The HTTP server could not be loaded: {e}")
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(func=_unavailable("serve", e))
        return
    # Accept either style: add_serve_parser(subparsers) -> parser, or add_serve_parser(parser).
    first = next(iter(inspect.signature(add_serve_parser).parameters), "")
    if "subparser" in first:
        parser = add_serve_parser(subparsers)
    else:
        parser = subparsers.add_parser("serve", help=help_text, description=help_text,
                                       formatter_class=_FORMATTER)
        parser = add_serve_parser(parser) or parser
    parser.set_defaults(func=run_serve)


def _add_module_command(subparsers: argparse._SubParsersAction, name: str, module_name: str,
                        help_text: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose module provides ``add_cli_args(parser)`` and ``main(args)``."""
    parser = subparsers.add_parser(name, help=help_text, description=description or help_text,
                                   formatter_class=_FORMATTER)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        parser.set_defaults(func=_unavailable(name, e))
        return parser
    module.add_cli_args(parser)
    parser.set_defaults(func=module.main)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="pagedllm: high-throughput LLM inference and serving "
        "(paged KV cache, continuous batching). With no --model, the bundled SmolLM2-135M-Instruct is used.",
        formatter_class=_FORMATTER)
    parser.add_argument("-v", "--version", action="version", version=f"pagedllm {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    _add_serve(subparsers)
    _add_module_command(subparsers, "generate", "pagedllm.entrypoints.cli.generate",
                        "Generate text for prompts given on the command line or stdin.")
    _add_module_command(subparsers, "chat", "pagedllm.entrypoints.cli.chat",
                        "Chat with a model in the terminal (streams replies; works with piped stdin).")
    _add_module_command(subparsers, "proxy", "pagedllm.entrypoints.cli.proxy",
                        "Disaggregated prefill / decode: one OpenAI-compatible front over prefill and decode "
                        "instances.")
    _add_module_command(subparsers, "transcribe", "pagedllm.entrypoints.cli.transcribe",
                        "Speech to text for audio files with a Whisper model (default whisper-base).")
    _add_module_command(subparsers, "models", "pagedllm.entrypoints.cli.models",
                        "List the supported model architectures and the formats each loads from.")

    bench = subparsers.add_parser("bench", help="Benchmarks: offline throughput and latency, online serving.",
                                  description="Benchmark pagedllm.", formatter_class=_FORMATTER)
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", title="benchmarks")
    _add_module_command(bench_sub, "throughput", "pagedllm.benchmarks.throughput",
                        "Offline throughput of many random prompts (pagedllm or Hugging Face backend).")
    _add_module_command(bench_sub, "latency", "pagedllm.benchmarks.latency",
                        "Latency of one batch: average, percentiles, TTFT and time per output token.")
    _add_module_command(bench_sub, "serve", "pagedllm.benchmarks.serve",
                        "Load a running server with Poisson-arriving streamed requests; TTFT, ITL, E2E.")
    _add_module_command(bench_sub, "prefix-caching", "pagedllm.benchmarks.prefix_caching",
                        "Shared-prefix workload with prefix caching on and off.")
    _add_module_command(bench_sub, "embed", "pagedllm.benchmarks.embed",
                        "Embedding throughput of a pooling model vs plain transformers, side by side.")
    _add_module_command(bench_sub, "structured-output", "pagedllm.benchmarks.structured_output",
                        "Chat requests under a JSON schema vs free, side by side; TTFT of new vs cached schemas.")
    _add_module_command(bench_sub, "kv-transfer", "pagedllm.benchmarks.kv_transfer",
                        "Time to move one prompt's KV blocks between two processes with the NixlConnector.")
    _add_module_command(bench_sub, "mixed-load", "pagedllm.benchmarks.mixed_load",
                        "Decode streams' inter-token latency while long prompts keep arriving (one instance or a "
                        "disaggregating proxy).")
    _add_module_command(bench_sub, "spec", "pagedllm.benchmarks.spec",
                        "Speculative decoding side by side (off, ngram, suffix) on chat workloads: repeat a "
                        "passage, edit code, an agent loop, random words.")
    _add_module_command(bench_sub, "transcription", "pagedllm.benchmarks.transcription",
                        "Speech-to-text clips per second and real-time factor, sequential and concurrent.")
    _add_module_command(bench_sub, "kernels", "pagedllm.benchmarks.kernels",
                        "The CPU kernel autotuner's table: per matmul shape and bucket of rows, the kernel chosen "
                        "and the ms per call of each candidate.")
    bench.set_defaults(func=lambda args: _print_help(bench))
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Handler | None = getattr(args, "func", None)
    if func is None:
        return _print_help(parser)
    try:
        result = func(args)
    except ValueError as e:  # bad user input: a message, not a traceback
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
