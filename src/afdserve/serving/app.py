"""The OpenAI-compatible HTTP API (FastAPI): routes, OpenAI-shaped errors, request metrics.

``create_app(engine, model_name)`` serves an ``AsyncEngine``; the app's lifespan starts the engine
thread and shuts the engine (and its worker processes) down.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from afdserve.serving.admin import admin_router
from afdserve.serving.async_engine import AsyncEngine
from afdserve.serving.chat import ChatTemplate
from afdserve.serving.edge import DEFAULT_MAX_BODY_BYTES, RequestGuard
from afdserve.serving.errors import ApiError, install_error_handlers
from afdserve.serving.generation import OpenAIServing
from afdserve.serving.jobs import JobOptions, JobStore
from afdserve.serving.jobs_api import jobs_router
from afdserve.serving.metrics import ServingMetrics
from afdserve.serving.openapi import limit_schema
from afdserve.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, ModelCard, ModelList)
from afdserve.serving.tokenization import (DetokenizeRequest, DetokenizeResponse, OpenAIServingTokenization,
                                           TokenizeRequest, TokenizeResponse, VersionResponse)
from afdserve.serving.tools import ToolConfig

API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/jobs")
HEALTH_TIMEOUT_S = 10.0  # /health fails when the engine loop has not turned for this long
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    413: {"model": ErrorResponse, "description": "the body is larger than the server accepts"},
    429: {"model": ErrorResponse, "description": "overloaded (see Retry-After)"},
    503: {"model": ErrorResponse, "description": "the deployment failed or is shutting down"},
}
_BODY_ERRORS = {k: _ERRORS[k] for k in (400, 413)}
_STREAM = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events with stream"}}
_UNAVAILABLE: dict[int | str, dict[str, Any]] = {503: {"model": ErrorResponse, "description": "not now"}}


class HealthResponse(BaseModel):
    status: str


class ReadyResponse(BaseModel):
    status: str
    workers: dict[str, str]  # worker -> up | down | restarting (empty for the colocated engine)


class _StatusMetrics:
    """Counts API responses by endpoint and status code (pure ASGI: streaming stays untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = "/v1/jobs" if scope["path"].startswith("/v1/jobs/") else scope["path"]
            self.metrics.request(path if path in API_PATHS else "other", status)


def create_app(engine: AsyncEngine, model_name: str, chat_template: ChatTemplate | None = None,
               tool_config: ToolConfig = ToolConfig(), *, admin_token: str | None = None,
               num_experts: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               health_timeout_s: float = HEALTH_TIMEOUT_S, jobs: JobOptions = JobOptions()) -> FastAPI:
    """The public API. The admin endpoints are on it only with ``admin_token`` (then behind
    ``Authorization: Bearer``); ``admin.create_admin_app`` serves them on a listener of their own.
    ``app.state.jobs`` is the ``JobStore`` (its ``clock`` may be replaced, e.g. in tests)."""
    metrics = ServingMetrics(engine.stats, lambda: engine.in_flight, lambda: engine.heartbeat_age)
    engine.observer = metrics
    if chat_template is None:
        tok = engine.tokenizer
        chat_template = ChatTemplate(tok.chat_template if tok else None, tok.bos_token if tok else None,
                                     tok.eos_token if tok else None)
    serving = OpenAIServing(engine, model_name, chat_template, tool_config)
    tokenization = OpenAIServingTokenization(engine, model_name, chat_template)
    job_store = JobStore(jobs)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        scaler = getattr(app.state, "autoscaler", None)  # serving.autoscaler.Autoscaler (serve --autoscale)
        if scaler is not None:
            scaler.start()
        try:
            yield
        finally:
            if scaler is not None:
                await scaler.stop()
            await engine.close()

    app = FastAPI(title="afdserve", version=version("afdserve"),
                  description="OpenAI-compatible API of an afdserve MoE deployment", lifespan=lifespan)
    app.state.metrics, app.state.engine, app.state.jobs = metrics, engine, job_store
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes)
    app.add_middleware(_StatusMetrics, metrics=metrics)

    def alive() -> None:
        """503 unless the engine loop turns (the deployment may still be starting workers)."""
        if engine.failed:
            raise ApiError(503, f"the deployment failed: {engine.failed}", code="unavailable")
        age = engine.heartbeat_age
        if age > health_timeout_s:
            raise ApiError(503, "the engine loop is not running" if age == float("inf") else
                           f"the engine loop has not turned for {age:.1f} s", code="unavailable")

    @app.get("/health", response_model=HealthResponse, responses=_UNAVAILABLE)
    async def health() -> HealthResponse:
        """Liveness: the engine loop turns (a heartbeat) and the deployment has not failed."""
        alive()
        return HealthResponse(status="ok")

    @app.get("/ready", response_model=ReadyResponse, responses=_UNAVAILABLE)
    async def ready() -> ReadyResponse:
        """Readiness: alive, not shutting down, and every worker up."""
        alive()
        if engine.closing:
            raise ApiError(503, "the server is shutting down", code="unavailable")
        workers = dict(engine.stats().workers)
        down = {w: s for w, s in sorted(workers.items()) if s != "up"}
        if down:
            raise ApiError(503, "workers not up: " + ", ".join(f"{w} {s}" for w, s in down.items()),
                           code="unavailable")
        return ReadyResponse(status="ready", workers=workers)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return serving.models()

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses={404: {"model": ErrorResponse, "description": "no such model"}})
    async def model(model_id: str) -> ModelCard:
        card = serving.models().data[0]
        if model_id != card.id:
            raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return card

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_BODY_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """A prompt, or chat messages rendered with the chat template, as token ids."""
        return await tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_BODY_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids as text (special tokens included)."""
        return await tokenization.detokenize(body)

    @app.get("/version", response_model=VersionResponse)
    async def server_version() -> VersionResponse:
        return VersionResponse(version=version("afdserve"))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS | _STREAM)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS | _STREAM)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    app.include_router(jobs_router(serving, job_store))

    if admin_token:
        app.include_router(admin_router(engine, num_experts, admin_token))

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, with this deployment's limits (``openapi.limit_schema``)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            limit_schema(schema, model_name, engine.vocab_size, engine.max_in_flight, num_experts)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
