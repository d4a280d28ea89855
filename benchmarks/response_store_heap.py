"""The Responses store's own memory: N responses shaped like the server's (conversations of ``--chain`` with their
``previous_response_id`` context) put into an ``InMemoryResponseStore``, and the Python heap it holds
(``tracemalloc``) against the bytes it counts toward ``--responses-store-max-bytes``. Seconds, no model:

    python benchmarks/response_store_heap.py --num-responses 10000 --max-bytes 268435456
    python benchmarks/response_store_heap.py --num-responses 10000 --max-bytes 4194304   # the bound evicting

(``benchmarks/responses_store_memory.py`` measures the same through a running server, generation included.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import tracemalloc

from pagedllm.entrypoints.openai.response_store import InMemoryResponseStore, StoredResponse


def _record(i: int, context: list) -> tuple[StoredResponse, list]:
    text = f"Response {i}: the number {i} is " + "interesting and even. " * 4
    output = [{"type": "message", "id": f"msg_{i:08x}", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    response = {"id": f"resp_{i:08x}", "object": "response", "created_at": 1765000000 + i, "status": "completed",
                "model": "m", "output": output, "temperature": 1.0, "top_p": 1.0, "tools": [],
                "tool_choice": "auto", "metadata": {}, "store": True,
                "usage": {"input_tokens": 40, "output_tokens": 32, "total_tokens": 72,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}
    inputs = [{"type": "message", "id": f"in_{i:08x}", "role": "user",
               "content": [{"type": "input_text", "text": f"Request {i}: say something about the number {i}."}]}]
    context = context + inputs + output
    return StoredResponse(response, inputs, context), context


async def measure(num: int, max_entries: int, max_bytes: int, chain: int) -> dict:
    store = InMemoryResponseStore(max_entries=max_entries, max_bytes=max_bytes)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    context: list = []
    start = time.perf_counter()
    for i in range(num):
        if i % chain == 0:
            context = []
        record, context = _record(i, context)
        await store.put(record.response["id"], record)
    seconds = time.perf_counter() - start
    context = []
    heap = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"responses_sent": num, "kept": len(store), "evicted": store.num_evicted, "max_bytes": max_bytes,
            "counted_bytes": store.num_bytes, "heap_bytes": heap, "heap_over_counted": round(heap / store.num_bytes, 3),
            "put_ms": round(seconds / num * 1000, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-responses", type=int, default=10_000)
    parser.add_argument("--max-entries", type=int, default=10_000)
    parser.add_argument("--max-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--chain", type=int, default=4, help="Responses per conversation.")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.num_responses, args.max_entries, args.max_bytes, args.chain))))


if __name__ == "__main__":
    main()
