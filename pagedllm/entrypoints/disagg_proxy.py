"""The disaggregation proxy (``pagedllm proxy``): one OpenAI-compatible front over prefill and decode instances.

Each completions / chat request goes twice: to a prefill instance (``kv_role`` ``kv_producer``) with
``max_tokens=1``, ``stream=false`` and ``kv_transfer_params: {"do_remote_decode": true}``, which computes the
prompt's KV cache, holds its blocks and answers where they are; then, with those ``kv_transfer_params``, to a
decode instance (``kv_consumer``), which reads the blocks and generates. The decode instance's answer (streamed
or not) goes back to the client as it is.

Instances of each kind are picked by ``policy``: ``least-loaded`` (fewest requests this proxy has in flight
there; ties in turn) or ``round-robin``. Faults: an instance that cannot be reached is skipped for the next one
of its kind; when none answers, or one breaks off, the client gets 502 (503 when no instance of a kind is
configured healthy), or an in-band error once a stream has started; the decode instance's request is aborted
when the client goes away (the proxy closes its upstream stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.errors import error_body
from pagedllm.entrypoints.streaming import ClosingStreamingResponse
from pagedllm.logger import init_logger

logger = init_logger(__name__)

POLICIES = ("least-loaded", "round-robin")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class UpstreamError(Exception):
    """An instance could not be reached or broke off; ``status`` is what the client gets."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class InstancePool:
    """The instances of one kind and the requests this proxy has in flight on each."""

    kind: str
    urls: list[str]
    policy: str = "least-loaded"
    in_flight: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.urls = [u.rstrip("/") for u in self.urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()

    def order(self) -> list[str]:
        """Every instance, the one to try first first."""
        start = next(self._turn) % len(self.urls)
        rotated = self.urls[start:] + self.urls[:start]
        if self.policy == "round-robin":
            return rotated
        return sorted(rotated, key=lambda u: self.in_flight[u])  # stable: ties keep the rotation


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    policy: str = "least-loaded"
    api_key: str | None = None  # what clients must send
    instance_api_key: str | None = None  # what the proxy sends to the instances
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 600.0


def build_app(config: ProxyConfig) -> FastAPI:
    for kind, urls in (("prefill", config.prefill), ("decode", config.decode)):
        if not urls:
            raise ValueError(f"--{kind}: at least one {kind} instance URL is needed")
    if config.policy not in POLICIES:
        raise ValueError(f"policy: must be one of {list(POLICIES)}, got {config.policy!r}")
    prefill = InstancePool("prefill", config.prefill, config.policy)
    decode = InstancePool("decode", config.decode, config.policy)
    timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if "client" in state:
            await state["client"].aclose()

    app = FastAPI(title="pagedllm disaggregation proxy", lifespan=lifespan)

    def client() -> httpx.AsyncClient:
        if "client" not in state:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            state["client"] = httpx.AsyncClient(timeout=timeout, limits=limits)
        return state["client"]

    def headers(request_id: str) -> dict[str, str]:
        out = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        if config.instance_api_key:
            out["Authorization"] = f"Bearer {config.instance_api_key}"
        return out

    def unauthorized(request: Request) -> JSONResponse | None:
        if config.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            return None
        return JSONResponse(error_body("Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                                       401), status_code=401, headers={"WWW-Authenticate": "Bearer"})

    async def send(pool: InstancePool, path: str, body: dict, request_id: str, stream: bool
                   ) -> tuple[httpx.Response, str]:
        """POST to the first instance of ``pool`` that can be reached (in policy order): (response, its URL).
        A streamed response counts as in flight there until ``_relay`` ends."""
        errors = []
        for url in pool.order():
            pool.in_flight[url] += 1
            try:
                req = client().build_request("POST", url + path, json=body, headers=headers(request_id))
                response = await client().send(req, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                pool.in_flight[url] -= 1
                logger.warning("proxy: %s instance %s unreachable (%s); trying the next one", pool.kind, url, e)
                errors.append(f"{url}: {type(e).__name__}")
                continue
            except httpx.HTTPError as e:
                pool.in_flight[url] -= 1
                raise UpstreamError(f"{pool.kind} instance {url} failed: {type(e).__name__}: {e}") from None
            if not stream:
                _release(pool, url)
            return response, url
        raise UpstreamError(f"no {pool.kind} instance could be reached ({'; '.join(errors)})")

    async def proxied(request: Request, path: str) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse(error_body("request body: not valid JSON", 400), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("request body: must be a JSON object", 400), status_code=400)
        if body.get("n", 1) != 1:
            return JSONResponse(error_body("n: the disaggregation proxy serves n = 1 only", 400, "n"),
                                status_code=400)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        if isinstance(first.get("min_tokens"), int) and first["min_tokens"] > 1:
            first["min_tokens"] = 1  # the prefill leg makes one token; the decode leg keeps the client's floor
        try:
            answer, _ = await send(prefill, path, first, request_id, stream=False)
        except UpstreamError as e:
            return JSONResponse(error_body(str(e), e.status), status_code=e.status)
        if answer.status_code != 200:  # the client's mistake (4xx) or the instance's (5xx): as it is
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        params = answer.json().get("kv_transfer_params")
        if not params:
            message = "the prefill instance returned no kv_transfer_params (start it with --kv-transfer-config " \
                      "and kv_role kv_producer)"
            return JSONResponse(error_body(message, 502), status_code=502)
        second = {**body, "kv_transfer_params": params}
        stream = bool(body.get("stream"))
        try:
            response, url = await send(decode, path, second, request_id, stream=stream)
        except UpstreamError as e:
            return JSONResponse(error_body(str(e), e.status), status_code=e.status)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        if not stream:
            return Response(response.content, status_code=response.status_code, headers=out_headers)
        media_type = response.headers.get("content-type", "text/event-stream")
        close = _closer(response, decode, url)
        return ClosingStreamingResponse(_relay(response, close), on_close=close, status_code=response.status_code,
                                        headers=out_headers, media_type=media_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxied(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxied(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        for url in decode.order():
            try:
                r = await client().get(url + "/v1/models", headers=headers(uuid.uuid4().hex))
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return JSONResponse(error_body("no decode instance could be reached", 503), status_code=503)

    @app.get("/health")
    async def health() -> Response:
        async def ok(url: str) -> bool:
            try:
                return (await client().get(url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                return False

        urls = prefill.urls + decode.urls
        results = dict(zip(urls, await asyncio.gather(*(ok(u) for u in urls))))
        healthy = {kind: [u for u in pool.urls if results[u]] for kind, pool in (("prefill", prefill),
                                                                                  ("decode", decode))}
        status = 200 if healthy["prefill"] and healthy["decode"] else 503
        return JSONResponse({"status": "ok" if status == 200 else "unavailable",
                             "instances": {u: ("ok" if results[u] else "down") for u in urls}}, status_code=status)

    return app


def _release(pool: InstancePool, url: str) -> None:
    pool.in_flight[url] = max(pool.in_flight[url] - 1, 0)


def _closer(response: httpx.Response, pool: InstancePool, url: str) -> Callable[[], Awaitable[None]]:
    """Closes the upstream response (the decode instance then aborts the request) and frees its slot in the
    pool, once however many times it is called."""
    done = False

    async def close() -> None:
        nonlocal done
        if not done:
            done = True
            await response.aclose()
            _release(pool, url)

    return close


async def _relay(response: httpx.Response, close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The decode instance's stream, byte for byte; an in-band error if it breaks off. ``close`` (``_closer``)
    when it ends, however it ends: a client that leaves makes the decode instance abort the request."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        logger.warning("proxy: the decode stream broke off (%s)", e)
        body = error_body(f"the decode instance broke off the stream: {type(e).__name__}", 502)
        yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await close()
