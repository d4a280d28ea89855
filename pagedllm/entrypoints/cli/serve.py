"""``pagedllm serve [MODEL]``: the OpenAI-compatible server. ``add_serve_parser`` + ``run_serve``."""

from __future__ import annotations

import argparse
import json

from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

DESCRIPTION = """Start the OpenAI-compatible HTTP server.

Endpoints: /v1/completions, /v1/chat/completions, /v1/responses (OpenAI's Responses API), /v1/messages
(Anthropic's Messages API), /v1/models, /tokenize, /detokenize, /health, /version,
/metrics (Prometheus, vLLM metric names), /reset_prefix_cache, /v1/kv_cache/snapshot (the block map), and a
browser playground at / (chat + a live map of the paged KV cache; --disable-frontend turns it off); with a
pooling model (--runner pooling, e.g. all-MiniLM-L6-v2) /v1/embeddings, /pooling and /score instead of
generation; with a Whisper model (e.g. whisper-base) /v1/audio/transcriptions and /v1/audio/translations
(docs/audio.md). Works with the official `openai` client:
  OpenAI(base_url="http://HOST:PORT/v1", api_key="KEY or anything")
"""



def _list_arg(value: str) -> list[str]:
    """A JSON list (vLLM's form, e.g. '["https://a.com"]') or a comma-separated list."""
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return items
    return [v.strip() for v in value.split(",") if v.strip()]


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="Address to listen on (default: all interfaces).")
    group.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000).")
    group.add_argument("--api-key", default=None,
                       help="Require 'Authorization: Bearer KEY' on all /v1 routes. Also read from the "
                            "PAGEDLLM_API_KEY environment variable (prefer that: argv is visible to others).")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="On SIGTERM/SIGINT stop accepting connections and let in-flight requests finish "
                            "for up to this many seconds, then abort the rest and exit 0 (default: 30).")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="Log level of uvicorn (access log at info).")
    group.add_argument("--allowed-origins", type=_list_arg, default=["*"],
                       help="CORS allowed origins: JSON list or comma-separated (default: *).")
    group.add_argument("--allowed-methods", type=_list_arg, default=["*"],
                       help="CORS allowed methods (default: *).")
    group.add_argument("--allowed-headers", type=_list_arg, default=["*"],
                       help="CORS allowed headers (default: *).")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    group.add_argument("--disable-frontend", action="store_true",
                       help="Do not serve the browser playground (chat page and live KV cache map) at / and "
                            "/playground/*; / then answers 404. The API, including /v1/kv_cache/snapshot, "
                            "is unchanged.")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="Accepted for vLLM compatibility and ignored: tool_choice 'auto' (also what tools "
                            "without tool_choice mean) is always on, parsed with --tool-call-parser. Named and "
                            "'required' tool choices always work (a grammar enforces them).")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="How tool calls look in the model's output for tool_choice 'auto' (default: the "
                            "format the model's chat template asks for; hermes, <tool_call>{...}</tool_call>, "
                            "when the template knows no tools and the built-in tool ChatML template is used).")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="Split a reasoning model's thinking from its answer: chat completions return it as "
                            "'reasoning' (and 'reasoning_content'), the Responses API as reasoning items; "
                            "structured outputs and tool calls apply to the answer after it. deepseek_r1: the "
                            "output thinks until </think>; qwen3: only when it starts with <think> "
                            "(default: none, the output is all answer).")
    group.add_argument("--responses-store-max-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                       help="The Responses API keeps stored responses (store: true, OpenAI's default) in memory "
                            "for retrieve, input_items and previous_response_id; at most this many, the least "
                            f"recently used dropped first; 0 stores none (default: {DEFAULT_MAX_ENTRIES}).")
    group.add_argument("--responses-store-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                       help="The Responses API's store keeps at most this many bytes of responses (their "
                            "JSON size: responses, their input items and the conversation they continue; "
                            f"default: {DEFAULT_MAX_BYTES // 2**20} MiB).")
    group.add_argument("--responses-store-ttl", type=float, default=DEFAULT_TTL_S,
                       help="Seconds a stored response is kept after it was stored; 0 keeps it until evicted "
                            f"(default: {int(DEFAULT_TTL_S)}, a day).")
    group.add_argument("--max-request-body-bytes", type=int, default=32 * 1024 * 1024,
                       help="Largest accepted request body; bigger ones get 413 (default: 32 MiB). Audio uploads "
                            "have their own limit, --max-audio-file-size-mb.")
    group.add_argument("--max-audio-file-size-mb", type=float, default=25.0,
                       help="Largest audio file /v1/audio/transcriptions and /translations accept, in MiB; a "
                            "bigger upload gets 413 whatever --max-request-body-bytes says (default: 25, OpenAI's).")
    group.add_argument("--max-audio-duration-s", type=float, default=3600.0,
                       help="Longest decoded audio accepted, in seconds (a small compressed file can hold hours; "
                            "longer uploads get 400). Audio over 30 s is cut into 30 s windows (default: 3600).")
    return parser


def make_serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    EngineArgs.add_cli_args(parser, positional_model=True)
    add_server_args(parser)
    parser.set_defaults(func=run_serve, dispatch_function=run_serve)
    return parser


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``pagedllm`` CLI; the parsed namespace's ``func`` is ``run_serve``."""
    parser = subparsers.add_parser("serve", help="Start the OpenAI-compatible server.",
                                   description=DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    return make_serve_parser(parser)


def run_serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm serve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    make_serve_parser(parser)
    run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
