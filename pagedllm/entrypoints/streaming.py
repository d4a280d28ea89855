"""A streamed HTTP response that closes its body generator as soon as the response ends, however it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """``StreamingResponse`` over an async generator whose ``finally`` aborts work (an engine request, an
    upstream stream). When the client leaves while a chunk is being sent, Starlette cancels the send and never
    resumes the generator: it would stay suspended at its ``yield`` (its request decoding on) until garbage
    collection finalizes it, which a reference cycle can put off past the answer's end. Closing it here
    aborts at once."""

    def __init__(self, body: AsyncIterator[Any], **kwargs: Any) -> None:
        kwargs.setdefault("media_type", "text/event-stream")
        super().__init__(body, **kwargs)
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()  # a no-op when the stream ran to its end
