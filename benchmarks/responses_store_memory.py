"""Memory of a running server's Responses store: send N stored responses, report the API process's resident
memory before and after, and check the store's bound (the oldest response is evicted once N passes
--responses-store-max-entries).

    pagedllm serve --served-model-name m --responses-store-max-entries 10000 &
    python benchmarks/responses_store_memory.py --base-url http://127.0.0.1:8000 --pid $! --num-responses 10000

``--pid`` is the ``pagedllm serve`` process (the API process holds the store; the engine cores are its children
and are not counted). Each response continues the previous one every ``--chain`` requests, so stored
conversations grow as an agent's do. Writes a JSON summary with ``--output-json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import psutil


async def send_all(base_url: str, model: str, num: int, concurrency: int, chain: int, max_tokens: int) -> list[str]:
    ids: list[str | None] = [None] * num
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(i: int) -> None:
            async with semaphore:
                body = {"model": model, "input": f"Request {i}: say something about the number {i}.",
                        "max_output_tokens": max_tokens, "temperature": 0}
                # Continue the conversation of an earlier response in the same chain (sent before it).
                if chain > 1 and i % chain and ids[i - 1] is not None:
                    body["previous_response_id"] = ids[i - 1]
                resp = await client.post("/v1/responses", json=body)
                resp.raise_for_status()
                ids[i] = resp.json()["id"]

        # Chains run in order inside, chains in parallel: request i waits for i - 1 of its chain.
        async def run_chain(start: int) -> None:
            for i in range(start, min(start + chain, num)):
                await one(i)

        await asyncio.gather(*(run_chain(s) for s in range(0, num, max(chain, 1))))
    return [i for i in ids if i is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, required=True, help="The pagedllm serve (API) process.")
    parser.add_argument("--model", default="m")
    parser.add_argument("--num-responses", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--chain", type=int, default=4, help="Responses per conversation (previous_response_id).")
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    proc = psutil.Process(args.pid)
    rss_before = proc.memory_info().rss
    start = time.perf_counter()
    ids = asyncio.run(send_all(args.base_url, args.model, args.num_responses, args.concurrency, args.chain,
                               args.max_output_tokens))
    elapsed = time.perf_counter() - start
    rss_after = proc.memory_info().rss
    first = httpx.get(f"{args.base_url}/v1/responses/{ids[0]}").status_code
    last = httpx.get(f"{args.base_url}/v1/responses/{ids[-1]}").status_code
    result = {"num_responses": len(ids), "seconds": round(elapsed, 1),
              "rss_before_mib": round(rss_before / 2**20, 1), "rss_after_mib": round(rss_after / 2**20, 1),
              "rss_growth_mib": round((rss_after - rss_before) / 2**20, 1),
              "growth_per_response_kib": round((rss_after - rss_before) / max(len(ids), 1) / 1024, 2),
              "oldest_status": first, "newest_status": last}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
