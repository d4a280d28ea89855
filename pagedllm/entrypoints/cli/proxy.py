"""``pagedllm proxy``: the disaggregation proxy over prefill and decode instances (``add_cli_args``, ``main``)."""

from __future__ import annotations

import argparse

from pagedllm import envs
from pagedllm.entrypoints.disagg_proxy import POLICIES, ProxyConfig, build_app

DESCRIPTION = """Serve one OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions, streamed or not,
/v1/models, /health) over separate prefill and decode instances: each request is prefilled on a prefill instance
(max_tokens=1, kv_transfer_params {"do_remote_decode": true}), then generated on a decode instance, which reads
the prompt's KV blocks from the prefill instance. Start the instances with `pagedllm serve --kv-transfer-config`
(kv_role kv_producer / kv_consumer); see docs/disaggregation.md."""


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = DESCRIPTION
    parser.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL", required=True,
                        help="Base URL of a prefill instance, e.g. http://127.0.0.1:8100 (repeat for several).")
    parser.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL", required=True,
                        help="Base URL of a decode instance (repeat for several).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: loopback).")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000).")
    parser.add_argument("--policy", default="least-loaded", choices=list(POLICIES),
                        help="Which instance of a kind gets a request: least-loaded (fewest requests in flight "
                             "through this proxy; default) or round-robin.")
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' from clients (default: PAGEDLLM_API_KEY, else "
                             "no key).")
    parser.add_argument("--instance-api-key", default=None,
                        help="The key sent to the instances (their --api-key; default: the proxy's own key).")
    parser.add_argument("--connect-timeout", type=float, default=3.0,
                        help="Seconds to wait for an instance to accept a connection before trying the next one.")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="Seconds an instance may take to answer (between bytes, when streaming).")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    api_key = args.api_key or envs.PAGEDLLM_API_KEY
    return ProxyConfig(prefill=list(args.prefill), decode=list(args.decode), policy=args.policy, api_key=api_key,
                       instance_api_key=args.instance_api_key or api_key, connect_timeout_s=args.connect_timeout,
                       request_timeout_s=args.request_timeout)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
