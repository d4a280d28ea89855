"""A streamed response whose client leaves mid-send closes its generator at once (its request aborts)."""

import asyncio

import pytest
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from pagedllm.entrypoints.streaming import ClosingStreamingResponse


def _events(closed: list[bool]):
    async def gen():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)
    return gen()


def _reader(source):
    """A body over ``source`` (the engine's outputs), as the servers' ``_stream`` methods are: closed at its
    yield, it leaves ``source`` suspended."""
    async def gen():
        async for event in source:
            yield event
    return gen()


async def _leave_during_second_chunk(response_cls, spec_version: str, closed: list | None = None,
                                     response=None) -> list[bool]:
    """Serve the response; the client leaves while the second body chunk is being sent. Whether the generator
    was closed, read as the response returns (before asyncio.run finalizes every generator left open)."""
    closed = [] if closed is None else closed
    response = response or response_cls(_events(closed), media_type="text/event-stream")
    left, sent = asyncio.Event(), []

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) == 3:
            left.set()
            if spec_version >= "2.4":
                raise OSError("client gone")  # how a 2.4 server reports it
            await asyncio.Event().wait()  # 2.3: the send hangs until the disconnect cancels it

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": spec_version}, "method": "POST", "path": "/"}
    try:
        await response(scope, receive, send)
    except ClientDisconnect:
        pass
    await asyncio.sleep(0)  # let anything scheduled by the response run
    return list(closed)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_generator_closed_when_the_client_leaves_mid_send(spec_version) -> None:
    closed = asyncio.run(_leave_during_second_chunk(ClosingStreamingResponse, spec_version))
    assert closed == [True]


def test_plain_streaming_response_leaves_it_suspended() -> None:
    """Why the subclass exists: Starlette's own response leaves the generator suspended at its yield."""
    closed = asyncio.run(_leave_during_second_chunk(StreamingResponse, "2.3"))
    assert closed == []


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_the_source_a_body_reads_is_closed_too(spec_version) -> None:
    """The engine outputs under a body are closed (their request aborted) when the body is closed at its
    yield, which does not close what it was iterating."""
    async def run(with_source: bool) -> list[bool]:
        closed: list[bool] = []
        source = _events(closed)
        response = ClosingStreamingResponse(_reader(source), on_close=source.aclose if with_source else None)
        return await _leave_during_second_chunk(None, spec_version, closed, response)

    assert asyncio.run(run(with_source=True)) == [True]
    assert asyncio.run(run(with_source=False)) == []  # the body alone left it open


def test_on_close_runs_when_the_body_never_started() -> None:
    """A client gone before the first chunk: the body's own ``finally`` never runs, ``on_close`` does."""
    closed: list[str] = []

    async def body():
        try:
            yield "data: 0\n\n"
        finally:
            closed.append("body")

    async def on_close() -> None:
        closed.append("source")

    async def send(message):
        raise OSError("client gone")

    async def receive():
        return {"type": "http.disconnect"}

    async def run() -> None:
        response = ClosingStreamingResponse(body(), on_close=on_close)
        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"},
                           receive, send)

    asyncio.run(run())
    assert closed == ["source"]
