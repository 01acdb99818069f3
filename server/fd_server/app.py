"""The OpenAI-compatible HTTP app of ``fd serve``, on top of an engine client.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (these
need the API key when one is set: ``Authorization: Bearer <key>``), and, always open so load
balancers and scrapers need no secret, ``GET /health``, ``GET /metrics``, ``GET /version``.

Lifecycle when the engine dies
------------------------------
The HTTP process and the engine-core process live and die together. When the engine-core
process dies (crash, out-of-memory kill, lost pipe):

1. ``/health`` answers 503 at once: it asks the engine client on every call, and a watcher
   polls it every 0.1 s besides.
2. Every request in flight ends at once with an error: a non-streamed one with a 503
   (``code: "engine_unavailable"``); a streamed one, whose 200 status is already sent, with one
   SSE event ``data: {"error": {...}}`` (the ``openai`` package raises it as ``APIError``), after
   which the stream closes without ``[DONE]``.
3. New requests get 503 with ``Retry-After``.
4. After a short grace period (``FD_ENGINE_DEAD_EXIT_S`` seconds, default 5), during which the
   balancer sees the failing health check and drains the replica, the server shuts down cleanly
   and the process exits with status 1, so a supervisor (systemd, Kubernetes, Docker restart
   policy) starts a fresh one. A server is never left running without an engine.

A *stalled* engine (alive, but silent past the heartbeat timeout) is not dead: ``/health``
and new requests get 503 until it reports again, and the server stays up.

Other behaviour worth knowing: a client that disconnects, streaming or not, has its request
aborted in the engine (its KV-cache blocks are freed at once); the limits of
``fd_server.limits`` bound what one request may cost (bodies, prompts × n, time, requests in
flight); errors are OpenAI error objects (see ``fd_server.errors`` for the status of each).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import fd_core
from fd_server import chat, completions, errors
from fd_server.errors import APIError, engine_unavailable
from fd_server.limits import MAX_BODY_BYTES, ServerLimits
from fd_server.metrics import CONTENT_TYPE, ServerMetrics
from fd_server.params import model_not_found
from fd_server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from fd_server.serving import ClientDisconnected, ServerContext, SSEResponse
from fd_server.streams import EngineMonitor
from fd_server.tools import ChatParsing

log = logging.getLogger("fd_server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in [(400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                         (429, "Too many requests in flight"), (503, "Engine unavailable")]
}


def _generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    ok = {"model": model, "description": "The completion; with stream=true, server-sent events of chunks",
          "content": {"text/event-stream": {}}}
    return {200: ok, **_ERRORS}


class ApiKeyMiddleware:
    """Checks ``Authorization: Bearer <key>`` on /v1 routes before anything else runs (a pure
    ASGI middleware, so streaming and disconnect detection are untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Missing or incorrect API key; send 'Authorization: Bearer <key>'.",
                                 type="authentication_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request's body before the app does, refusing it (413) as soon as it passes
    ``limit`` bytes: by its declared Content-Length at once, and for a chunked upload (which
    declares none) when the bytes received so far pass it; the app then reads the buffered
    body. Nothing larger than ``limit`` is ever held in memory."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, which the handlers watch for

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"The request body must be at most {self.limit} bytes.", code="request_too_large",
                         headers={"Connection": "close"})  # the rest of the body is never read
        await error.response()(scope, receive, send)


def _exact_numbers(documented: Any, exact: Any) -> None:
    """Put back the integers FastAPI's OpenAPI model turned into floats (it types ``maximum`` as a
    float, so 2**63 - 1 came out as 9.223372036854776e18, a bound no client can check exactly)."""
    if isinstance(documented, dict) and isinstance(exact, dict):
        for key, value in documented.items():
            if key not in exact:
                continue
            if isinstance(value, float) and isinstance(exact[key], int) and not isinstance(exact[key], bool):
                documented[key] = exact[key]
            else:
                _exact_numbers(value, exact[key])
    elif isinstance(documented, list) and isinstance(exact, list) and len(documented) == len(exact):
        for a, b in zip(documented, exact):
            _exact_numbers(a, b)


def build_app(client: Any, served_model_name: str | Sequence[str], api_key: str | None = None,
              limits: ServerLimits | None = None, log_requests: bool = True,
              parsing: ChatParsing | None = None) -> FastAPI:
    """The app serving ``client`` under the model name ``served_model_name`` (or several names,
    any of which a request may ask for; responses and metrics carry the first), within ``limits``;
    ``log_requests``: a log line per request received and ended (``fd_server.request_log``).

    ``app.state.monitor.dead`` is an ``asyncio.Event`` set when the engine dies; whoever runs
    the app (``fd_server.launch``) exits after the grace period."""
    limits = limits or ServerLimits()
    max_concurrency = limits.max_concurrency
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    served_model_name = names[0]
    metrics = ServerMetrics(client, served_model_name)
    monitor = EngineMonitor(client, max_concurrency, on_finished=metrics.observe,
                            heartbeat_timeout=limits.heartbeat_timeout, on_output=metrics.on_output)
    pool = concurrent.futures.ThreadPoolExecutor(limits.tokenizer_pool_size, thread_name_prefix="fd-tokenize")
    ctx = ServerContext(client=client, monitor=monitor, model_name=served_model_name, model_names=names, pool=pool,
                        max_sequences_per_request=limits.max_sequences_per_request,
                        request_timeout=limits.request_timeout or None, log_requests=log_requests,
                        parsing=parsing or ChatParsing())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.ensure_future(monitor.watch())
        try:
            yield
        finally:
            watcher.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="fd", version=fd_core.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the fd engine.")
    app.state.monitor = monitor
    app.state.metrics = metrics
    app.state.context = ctx
    errors.install(app)
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_body_bytes)
    if api_key:  # added last, so it runs first: no body is read for a client without the key
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    async def generate(create: Callable[..., Awaitable[Any]], body: Any, request: Request) -> Response:
        if not monitor.healthy():
            return engine_unavailable(monitor.unavailable_reason()).response()
        if not monitor.admit():
            return APIError(429, f"The server already has {max_concurrency} requests in flight; retry shortly.",
                            type="rate_limit_error", code="rate_limit_exceeded",
                            headers={"Retry-After": "1"}).response()
        try:
            result = await create(ctx, body, request)
        except ClientDisconnected:
            monitor.release()
            return Response(status_code=499)  # nobody reads it; the access log shows what happened
        except Exception as exc:
            monitor.release()
            return errors.from_exception(exc).response()
        except BaseException:
            monitor.release()
            raise
        if isinstance(result, SSEResponse):
            result.on_close.append(monitor.release)
            return result
        monitor.release()
        return Response(result.model_dump_json(), media_type="application/json")

    @app.post("/v1/chat/completions", response_model=None, responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(chat.create, body, request)

    @app.post("/v1/completions", response_model=None, responses=_generation_responses(CompletionResponse))
    async def text_completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(completions.create, body, request)

    def card(name: str) -> ModelCard:
        config = getattr(client, "config", None)
        return ModelCard(id=name, root=getattr(config, "model", None), max_model_len=client.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: _ERRORS[404]})
    async def model(model: str) -> ModelCard:
        if model not in names:
            raise model_not_found(model, names)
        return card(model)

    @app.get("/health", responses={200: {"description": "The engine is healthy"}, 503: _ERRORS[503]})
    async def health() -> Response:
        if monitor.healthy():
            return JSONResponse({"status": "ok"})
        return engine_unavailable(monitor.unavailable_reason()).response()

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from fd_core.interfaces import API_VERSION

        return {"version": fd_core.__version__, "plugin_api": API_VERSION}

    def openapi() -> dict[str, Any]:
        # FastAPI documents its own 422; this server answers 400 instead (see fd_server.errors)
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for model in (ChatCompletionRequest, CompletionRequest):
                exact = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, part in [(model.__name__, exact), *exact.get("$defs", {}).items()]:
                    if name in components:
                        _exact_numbers(components[name], part)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
