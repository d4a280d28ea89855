"""The OpenAI-compatible HTTP server: app factory (``build_app``) and ``run_server(args)``.

The engine cores run in their own processes behind ``AsyncLLM`` (``engine/mp_engine.py``); this module only
routes, authenticates and shapes errors.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm import envs
from pagedllm.audio.transcription import DEFAULT_MAX_DURATION_S, is_transcription_model
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.errors import EngineDeadError, RequestFailedError
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, error_response, param_of
from pagedllm.entrypoints.openai.playground import add_frontend_routes, add_kv_cache_routes
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    PoolingRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.protocol_messages import MessagesCountRequest, MessagesRequest, anthropic_error_body
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.response_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    DEFAULT_TTL_S,
    InMemoryResponseStore,
)
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_completion import ServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import ServingEmbedding
from pagedllm.entrypoints.openai.serving_messages import ServingMessages
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.entrypoints.openai.serving_responses import ServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import ServingTokenization
from pagedllm.entrypoints.openai.serving_transcription import (
    AUDIO_PATHS,
    DEFAULT_MAX_FILE_MB,
    FORM_OVERHEAD_BYTES,
    ServingTranscription,
    upload_limit_message,
)
from pagedllm.logger import init_logger
from pagedllm.metrics.audio import AudioMetrics
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.utils import freeze_gc_heap

logger = init_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerOptions:
    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 0.0
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    enable_frontend: bool = True  # the browser playground at / (--disable-frontend turns it off)
    tool_call_parser: str | None = None  # None: the parser matching the model's chat template
    reasoning_parser: str | None = None  # --reasoning-parser: None = the output is all answer
    # The Responses API's store (--responses-store-max-entries / -max-bytes / -ttl)
    responses_store_max_entries: int = DEFAULT_MAX_ENTRIES
    responses_store_max_bytes: int = DEFAULT_MAX_BYTES
    responses_store_ttl_s: float = DEFAULT_TTL_S
    max_audio_file_bytes: int = int(DEFAULT_MAX_FILE_MB * 2**20)  # /v1/audio/* uploads (--max-audio-file-size-mb)
    max_audio_duration_s: float = DEFAULT_MAX_DURATION_S  # decoded audio (--max-audio-duration-s)


class GuardMiddleware:
    """Pure ASGI: X-Request-Id echo, request body limit, and the API key on ``/v1`` routes.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass straight through.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 path_limits: dict[str, tuple[int, Any]] | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        # Paths with a limit of their own instead of max_body_bytes: path -> (bytes, message(size | None)).
        self.path_limits = path_limits or {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        request_id = headers.get("x-request-id")
        if request_id is not None:
            async def send_with_id(message: dict) -> None:
                if message["type"] == "http.response.start":
                    message.setdefault("headers", [])
                    message["headers"] = list(message["headers"]) + [(b"x-request-id", request_id)]
                await send(message)
            out_send = send_with_id
        else:
            out_send = send

        async def reply(status: int, message: str) -> None:
            extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            await api_error_response(scope["path"], message, status, headers=extra)(scope, receive, out_send)

        if self.api_key is not None and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = headers.get("authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not given and "x-api-key" in headers:  # how Anthropic's clients send the key
                scheme, token = b"bearer", headers["x-api-key"]
            # Constant-time compare so the key can't be guessed byte by byte from timings.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return await reply(401, "Unauthorized: a valid API key is required "
                                        "(Authorization: Bearer <key>)")

        length = headers.get("content-length")
        limit, too_large = self.path_limits.get(scope["path"], (self.max_body_bytes, None))
        if too_large is None:
            def too_large(size: int | None) -> str:
                got = f"of {size} bytes " if size is not None else ""
                return f"Request body {got}exceeds the limit of {limit} bytes"
        if length is not None and length.isdigit() and int(length) > limit:
            return await reply(413, too_large(int(length)))
        if scope["method"] in ("POST", "PUT", "PATCH") and length is None:
            # Chunked upload: buffer it here so the limit holds without a Content-Length.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > limit:
                    return await reply(413, too_large(None))
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()

            return await self.app(scope, replay, out_send)
        return await self.app(scope, receive, out_send)


def api_error_response(path: str, message: str, status: int = 400, param: str | None = None,
                       headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the API the path belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(message, status), status_code=status, headers=headers)
    return error_response(message, status, param, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return f"Invalid JSON in request body: {err.get('msg')}", None
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {err.get('msg')}{more}", param


def build_app(engine: AsyncLLM, options: ServerOptions, metrics: PrometheusMetrics | None = None) -> FastAPI:
    """The FastAPI app around a running ``AsyncLLM``."""
    core = engine.engine
    tokenizer = copy.deepcopy(core.get_tokenizer())
    model_path = core.config.model.model_path or core.config.model.model
    lora = getattr(core.config, "lora", None)
    models = ServingModels(options.served_model_names, model_path, core.processor.max_model_len,
                           getattr(core.config.model, "architecture", "") or None,
                           resolve_adapter=core.resolve_lora if lora is not None else None)
    for name, path, _ in lora.lora_modules if lora is not None else ():
        models.add_adapter(name, path)  # --lora-modules: a bad adapter stops the start-up, saying why
    completion = ServingCompletion(engine, models, tokenizer)
    chat = ServingChat(engine, models, tokenizer)
    chat.configure_tools(options.tool_call_parser)
    logger.info("tool_choice 'auto' parses tool calls with the %s parser", chat.tool_parser.name)
    chat.configure_reasoning(options.reasoning_parser)
    if chat.reasoning_parser is not None:
        logger.info("reasoning split off the answer with the %s parser", chat.reasoning_parser.name)
    tokenization = ServingTokenization(chat)
    store = InMemoryResponseStore(options.responses_store_max_entries, options.responses_store_max_bytes,
                                  options.responses_store_ttl_s)
    responses = ServingResponses(chat, store)
    messages = ServingMessages(chat)
    is_pooling = bool(getattr(core.config.model, "is_pooling", False))
    embedding = ServingEmbedding(engine, models, tokenizer) if is_pooling else None
    audio_metrics = None
    if metrics is not None and is_transcription_model(core.config.model):
        audio_metrics = AudioMetrics(metrics.registry, metrics.model_name)
    transcription = ServingTranscription(engine, models, tokenizer, core.config.model, core.processor.max_model_len,
                                         options.max_audio_file_bytes, options.max_audio_duration_s, audio_metrics)

    def runner_check(pooling_endpoint: bool) -> None:
        """Generation endpoints on a pooling model, and pooling endpoints on a generative one: 400."""
        if pooling_endpoint and not is_pooling:
            raise OpenAIError(f"The model `{models.default_name}` is a generative model and does not support "
                              "the embeddings/pooling/score API; serve an embedding model or use --runner pooling",
                              param="model")
        if not pooling_endpoint and is_pooling:
            raise OpenAIError(f"The model `{models.default_name}` is a pooling (embedding) model and does not "
                              "support text generation; use /v1/embeddings", param="model")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Uvicorn has already drained HTTP connections for up to --shutdown-timeout; end what is left.
        await asyncio.to_thread(engine.shutdown, 0.0)

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.response_store = store

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return api_error_response(request.url.path, exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return api_error_response(request.url.path, message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return api_error_response(request.url.path, message, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return api_error_response(request.url.path, str(exc), 503)

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return api_error_response(request.url.path, str(exc), 500)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return api_error_response(request.url.path, str(exc), 400, param_of(str(exc)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return api_error_response(request.url.path, f"Internal server error: {type(exc).__name__}", 500)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        reason = "engine is dead" if engine.errored is not None else "engine is stopping"
        return JSONResponse(error_body(f"Unhealthy: {reason}", 503), status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.list().model_dump())

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        runner_check(pooling_endpoint=False)
        return await completion.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        runner_check(pooling_endpoint=False)
        return await chat.create(req, raw)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        runner_check(pooling_endpoint=False)
        return await responses.create(req, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return await responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        return await responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        return await responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, order: str = "desc", limit: int = 20,
                               after: str | None = None) -> JSONResponse:
        return await responses.input_items(response_id, order, limit, after)

    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw: Request):
        runner_check(pooling_endpoint=False)
        return await messages.create(req, raw)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: MessagesCountRequest) -> JSONResponse:
        runner_check(pooling_endpoint=False)
        return await messages.count_tokens(req)

    @app.post("/v1/embeddings")
    async def create_embeddings(req: EmbeddingRequest, raw: Request):
        runner_check(pooling_endpoint=True)
        return await embedding.embeddings(req, raw)

    @app.post("/pooling")
    async def create_pooling(req: PoolingRequest, raw: Request):
        runner_check(pooling_endpoint=True)
        return await embedding.pooling(req, raw)

    @app.post("/score")
    async def create_score(req: ScoreRequest, raw: Request):
        runner_check(pooling_endpoint=True)
        return await embedding.score(req, raw)

    @app.post("/v1/audio/transcriptions")
    async def create_transcription(raw: Request):
        return await transcription.create(raw, "transcribe")

    @app.post("/v1/audio/translations")
    async def create_translation(raw: Request):
        return await transcription.create(raw, "translate")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.tokenize(req).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.detokenize(req).model_dump())

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        await models.load_adapter(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        models.unload_adapter(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await engine.call_utility("reset_prefix_cache")
        return Response(status_code=200)

    add_kv_cache_routes(app, engine)
    if options.enable_frontend:
        add_frontend_routes(app)

    # Outermost first: CORS answers preflights before the guard asks for a key.
    # Audio uploads answer to their own limit (the file plus its form), never to the general body limit.
    audio_limit = (options.max_audio_file_bytes + FORM_OVERHEAD_BYTES,
                   lambda size: upload_limit_message(size, options.max_audio_file_bytes))
    app.add_middleware(GuardMiddleware, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                       path_limits={path: audio_limit for path in AUDIO_PATHS})
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                       allow_credentials=options.allow_credentials, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers)
    return app


def _draining_server(config: Any) -> Any:
    import signal

    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # Uvicorn re-raises the caught signal after its graceful shutdown, so the process would die
            # by SIGTERM; a drained stop is a clean one and must exit 0.
            captured = getattr(self, "_captured_signals", None)
            if sig in (signal.SIGTERM, signal.SIGINT) and captured and captured[-1] == sig:
                captured.pop()

    return DrainingServer(config)


def run_server(args: argparse.Namespace) -> None:
    """Build the engine from CLI args, print the banner, serve until SIGINT/SIGTERM, then drain."""

    import prometheus_client
    import uvicorn

    from pagedllm.engine_args import EngineArgs
    from pagedllm.metrics.stats import StatsRecorder

    prometheus_client.disable_created_metrics()  # no *_created series, as vLLM
    engine_args = EngineArgs.from_cli_args(args)
    api_key = args.api_key or envs.PAGEDLLM_API_KEY or None
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        config = engine.engine.config
        names = [config.model.name]
        metrics = PrometheusMetrics(names[0], config.scheduler.max_model_len,
                                    config.scheduler.max_num_batched_tokens)
        engine.stat_logger = StatsRecorder(metrics, log_stats=config.log_stats)
        options = ServerOptions(
            served_model_names=names, api_key=api_key, max_body_bytes=args.max_request_body_bytes,
            shutdown_timeout=args.shutdown_timeout, allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials, enable_frontend=not getattr(args, "disable_frontend", False),
            tool_call_parser=getattr(args, "tool_call_parser", None),
            reasoning_parser=getattr(args, "reasoning_parser", None),
            responses_store_max_entries=getattr(args, "responses_store_max_entries", DEFAULT_MAX_ENTRIES),
            responses_store_max_bytes=getattr(args, "responses_store_max_bytes", DEFAULT_MAX_BYTES),
            responses_store_ttl_s=getattr(args, "responses_store_ttl", DEFAULT_TTL_S),
            max_audio_file_bytes=int(getattr(args, "max_audio_file_size_mb", DEFAULT_MAX_FILE_MB) * 2**20),
            max_audio_duration_s=getattr(args, "max_audio_duration_s", DEFAULT_MAX_DURATION_S))
        app = build_app(engine, options, metrics)

        display_host = args.host if args.host not in ("", "0.0.0.0", "::") else "localhost"
        logger.info("pagedllm %s serving %s as %s", pagedllm.__version__, config.model.model, ", ".join(names))
        logger.info("dtype %s, max_model_len %d, KV cache %d blocks x %d tokens, API key %s",
                    config.model.dtype, config.scheduler.max_model_len, config.cache.num_blocks,
                    config.cache.block_size, "required" if api_key else "off")
        pids = getattr(engine.engine, "pids", None)
        if pids is not None:
            logger.info("%d engine core process%s (pid %s); this process serves HTTP, tokenizes and detokenizes",
                        len(pids), "es" if len(pids) > 1 else "", ", ".join(map(str, pids)))
        logger.info("OpenAI-compatible API at http://%s:%d/v1 (health: /health, metrics: /metrics)",
                    display_host, args.port)
        if options.enable_frontend:
            logger.info("Playground (chat + live KV cache map) at http://%s:%d/ (turn off with --disable-frontend)",
                        display_host, args.port)
        freeze_gc_heap()  # this process's start-up state lives as long as the server
        server = _draining_server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.shutdown_timeout if args.shutdown_timeout > 0 else None,
            timeout_keep_alive=5))
        server.run()
    finally:
        engine.shutdown(0.0)  # also after a failure before serving: no engine process outlives the server
    logger.info("server stopped")
