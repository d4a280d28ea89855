"""``until_disconnect``: a non-streamed handler runs until it answers or its client leaves."""

from __future__ import annotations

import asyncio

from pagedllm.entrypoints.openai.serving_engine import until_disconnect


class _Request:
    """A Starlette request stand-in whose client leaves after ``delay`` seconds (None: never)."""

    def __init__(self, delay: float | None) -> None:
        self.delay = delay

    async def receive(self) -> dict:
        if self.delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay)
        return {"type": "http.disconnect"}


def test_the_answer_comes_back() -> None:
    async def handler() -> str:
        await asyncio.sleep(0.01)
        return "answer"

    assert asyncio.run(until_disconnect(_Request(None), handler())) == "answer"


def test_a_client_gone_first_cancels_the_handler_and_returns_nothing() -> None:
    """The handler is still unwinding its cancellation when the watcher wins: no InvalidStateError (it was a 500
    logged as an unhandled error for every non-streamed request whose client left)."""
    unwound = []

    async def handler() -> str:
        try:
            await asyncio.sleep(60)
        finally:
            unwound.append(True)
        return "never"

    async def main() -> object:
        result = await until_disconnect(_Request(0.01), handler())
        await asyncio.sleep(0.01)  # the cancelled handler unwinds on the next turns of the loop
        return result

    assert asyncio.run(main()) is None
    assert unwound == [True]
