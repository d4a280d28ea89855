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
    aborts at once.

    ``source``: the engine outputs the body reads (an async generator whose closing aborts the request). A body
    closed at its ``yield`` leaves the iterator it was reading suspended, not closed, and a body closed before
    its first step never reached it: so the source is closed here too, after the body."""

    def __init__(self, body: AsyncIterator[Any], source: AsyncIterator[Any] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("media_type", "text/event-stream")
        super().__init__(body, **kwargs)
        self._body, self._source = body, source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()  # a no-op when the stream ran to its end
            finally:
                if self._source is not None:
                    await self._source.aclose()
