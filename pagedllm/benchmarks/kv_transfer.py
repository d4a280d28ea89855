"""`pagedllm bench kv-transfer`: how long the NixlConnector takes to move one prompt's KV blocks between processes.

A producer process registers a KV cache of the given layout (default: SmolLM2-135M's, 30 layers x 3 KV heads x
64 dims, float32, 16-token blocks); this process, the consumer, handshakes once (not timed), then receives a
``--prompt-len``-token prompt's blocks ``--repeats`` times through the connector's worker half: from the
metadata handed to ``start_load_kv`` to ``get_finished`` reporting it (descriptor lists, the NIXL READ, the
polling). It prints the median and best time per prompt and per block.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

from pagedllm.utils import cdiv


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prompt-len", type=int, default=3000, help="Tokens whose blocks move per transfer.")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                        help="Caches on transparent huge pages, as an engine with a KV connector has them.")
    parser.add_argument("--repeats", type=int, default=20, help="Timed transfers (after one warm-up).")
    parser.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    return parser


def _layout(args: argparse.Namespace) -> dict[str, Any]:
    num_blocks = cdiv(args.prompt_len, args.block_size) * 2 + 1
    return {"layers": args.num_layers, "shape": (2, num_blocks, args.block_size, args.num_kv_heads, args.head_dim),
            "dtype": args.dtype, "block_size": args.block_size, "huge_pages": args.huge_pages}


def _connector(role: str, layout: dict[str, Any]):
    import torch

    from pagedllm.distributed.kv_transfer.base import KVConnectorRole
    from pagedllm.distributed.kv_transfer.config import parse_kv_transfer_config
    from pagedllm.distributed.kv_transfer.nixl import NixlConnector
    from pagedllm.platforms.cpu_memory import zeroed_host_tensor

    config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": role})
    conn = NixlConnector(config, KVConnectorRole.WORKER, layout["block_size"])
    dtype = getattr(torch, layout["dtype"])
    caches = []
    for _ in range(layout["layers"]):  # as the engine allocates them
        cache = zeroed_host_tensor(layout["shape"], dtype, huge_pages=layout["huge_pages"])
        caches.append(cache.copy_(torch.rand(layout["shape"])))
    conn.register_kv_caches(caches)
    return conn


def _producer(layout: dict[str, Any], pipe: Any) -> None:
    conn = _connector("kv_producer", layout)
    pipe.send((conn.config.engine_id, conn.side_channel_port))
    pipe.recv()  # until the consumer is done
    conn.shutdown()


def main(args: argparse.Namespace) -> int:
    from pagedllm.distributed.kv_transfer.nixl import NixlMetadata, RecvSpec

    layout = _layout(args)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(layout, child), daemon=True)
    proc.start()
    engine_id, port = parent.recv()
    consumer = _connector("kv_consumer", layout)
    num = cdiv(args.prompt_len, args.block_size)
    remote = list(range(1, num + 1))
    local = list(range(num + 1, 2 * num + 1))
    times = []
    try:
        for i in range(args.repeats + 1):
            rid = f"bench-{i}"
            spec = RecvSpec(local, remote, engine_id, "127.0.0.1", port, rid)
            start = time.perf_counter()
            consumer.bind_connector_metadata(NixlMetadata(recv={rid: spec}))
            consumer.start_load_kv()
            while True:
                out = consumer.get_finished(set())
                if rid in out.finished_recving or rid in out.failed_recving:
                    break
            elapsed = time.perf_counter() - start
            if rid in out.failed_recving:
                raise RuntimeError("a transfer failed; see the log")
            if i:  # the first includes the handshake
                times.append(elapsed)
    finally:
        consumer.shutdown()
        parent.send("done")
        proc.join(10)
    median, best = statistics.median(times), min(times)
    block_bytes = 2 * layout["layers"] * consumer.block_bytes
    result = {"prompt_len": args.prompt_len, "blocks": num, "bytes_per_block": block_bytes,
              "median_ms": median * 1e3, "best_ms": best * 1e3, "median_us_per_block": median / num * 1e6,
              "best_us_per_block": best / num * 1e6, "GBps_median": num * block_bytes / median / 1e9}
    print(f"{num} blocks ({args.prompt_len} tokens, {block_bytes} bytes a block over all layers): "
          f"median {median * 1e3:.2f} ms ({median / num * 1e6:.1f} us a block, "
          f"{result['GBps_median']:.2f} GB/s), best {best * 1e3:.2f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
