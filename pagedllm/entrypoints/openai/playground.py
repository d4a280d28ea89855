"""The browser playground (``GET /`` and its assets) and the KV cache snapshot (``GET /v1/kv_cache/snapshot``).

The page is static files shipped in the package (``frontend/``): no CDN, no build step. It talks to the
server only through the public API (``/v1/...``), with the same API key as any client. The snapshot
endpoint returns what the engine thread last published (``engine/engine_snapshot.py``); it never reads
engine internals from the HTTP side.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import error_response

FRONTEND_DIR = Path(__file__).parent / "frontend"
ASSET_PREFIX = "/playground"
_MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
# Served by name from this fixed list (no path from the URL reaches the filesystem).
ASSETS = {p.name: _MEDIA_TYPES[p.suffix] for p in sorted(FRONTEND_DIR.iterdir()) if p.suffix in _MEDIA_TYPES}
# The page runs only its own scripts and talks only to this server; no one may frame it (the API key
# sits in its session storage). Media only from blob: URLs: the audio tab plays back the clip it sends.
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self' data:; media-src blob:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_frontend_routes(app: FastAPI) -> None:
    """``GET /`` (the page) and ``GET /playground/<asset>``."""

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return FileResponse(FRONTEND_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers=SECURITY_HEADERS)

    @app.get(ASSET_PREFIX + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media_type = ASSETS.get(name)
        if media_type is None:
            return error_response(f"No such playground asset: {name}", 404)
        return FileResponse(FRONTEND_DIR / name, media_type=media_type, headers=SECURITY_HEADERS)


def add_kv_cache_routes(app: FastAPI, engine: AsyncLLM) -> None:
    """``GET /v1/kv_cache/snapshot``: the block map and scheduler counters as compact JSON."""

    @app.get("/v1/kv_cache/snapshot")
    async def kv_cache_snapshot() -> Response:
        snap = await engine.kv_cache_snapshot()
        if snap is None:
            return error_response("The KV cache snapshot is unavailable (see the server log).", 503)
        return Response(snap.json_bytes, media_type="application/json", headers={"Cache-Control": "no-store"})
