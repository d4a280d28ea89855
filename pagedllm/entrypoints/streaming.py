"""A streamed HTTP response that closes its body generator as soon as the response ends, however it ends."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """``StreamingResponse`` over an async generator whose ``finally`` aborts work (an engine request, an
    upstream stream). When the client leaves while a chunk is being sent, Starlette cancels the send and never
    resumes the generator: it would stay suspended at its ``yield`` (its request decoding on) until garbage
    collection finalizes it, which a reference cycle can put off past the answer's end. Closing it here
    aborts at once.

    ``on_close``: what frees the body's source (closing the engine outputs it reads, which aborts the request;
    an upstream stream), awaited after the body is closed. A body closed at its ``yield`` leaves the iterator it
    was reading suspended, not closed, and a body closed before its first step never reached it, so its own
    ``finally`` cannot be relied on for that. It may run twice (the body's ``finally`` may call it too): make it
    idempotent."""

    def __init__(self, body: AsyncGenerator[Any, None], on_close: Callable[[], Awaitable[Any]] | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("media_type", "text/event-stream")
        super().__init__(body, **kwargs)
        self._body, self._on_close = body, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()  # a no-op when the stream ran to its end
            finally:
                if self._on_close is not None:
                    await self._on_close()
