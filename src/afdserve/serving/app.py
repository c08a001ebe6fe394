"""The OpenAI-compatible HTTP API (FastAPI): routes, OpenAI-shaped errors, request metrics.

``create_app(engine, model_name)`` serves an ``AsyncEngine``; the app's lifespan starts the engine
thread and shuts the engine (and its worker processes) down.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from importlib.metadata import version

from afdserve.errors import AfdServeError, ConfigError
from afdserve.serving.async_engine import AsyncEngine
from afdserve.serving.chat import ChatTemplate
from afdserve.serving.errors import ApiError, validation_error
from afdserve.serving.generation import OpenAIServing
from afdserve.serving.metrics import ServingMetrics
from afdserve.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, ModelCard, ModelList, RebalanceRequest,
                                       RebalanceResponse)
from afdserve.serving.tokenization import (DetokenizeRequest, DetokenizeResponse, OpenAIServingTokenization,
                                           TokenizeRequest, TokenizeResponse, VersionResponse)
from afdserve.serving.tools import ToolConfig

API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    429: {"model": ErrorResponse, "description": "overloaded (see Retry-After)"},
    503: {"model": ErrorResponse, "description": "the deployment failed or is shutting down"},
}
_STREAM = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events with stream"}}


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
            path = scope["path"]
            self.metrics.request(path if path in API_PATHS else "other", status)


def create_app(engine: AsyncEngine, model_name: str, chat_template: ChatTemplate | None = None,
               tool_config: ToolConfig = ToolConfig()) -> FastAPI:
    metrics = ServingMetrics(engine.stats, lambda: engine.in_flight)
    engine.observer = metrics
    if chat_template is None:
        tok = engine.tokenizer
        chat_template = ChatTemplate(tok.chat_template if tok else None, tok.bos_token if tok else None,
                                     tok.eos_token if tok else None)
    serving = OpenAIServing(engine, model_name, chat_template, tool_config)
    tokenization = OpenAIServingTokenization(engine, model_name, chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="afdserve", version=version("afdserve"),
                  description="OpenAI-compatible API of an afdserve MoE deployment", lifespan=lifespan)
    app.state.metrics, app.state.engine = metrics, engine
    app.add_middleware(_StatusMetrics, metrics=metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail))
        resp = err.response()
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.failed:
            return ApiError(503, f"the deployment failed: {engine.failed}", code="unavailable").response()
        return JSONResponse({"status": "ok"})

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

    @app.post("/tokenize", response_model=TokenizeResponse, responses={400: _ERRORS[400]})
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """A prompt, or chat messages rendered with the chat template, as token ids."""
        return await tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses={400: _ERRORS[400]})
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

    @app.post("/admin/rebalance", response_model=RebalanceResponse, responses=_ERRORS)
    async def rebalance(body: RebalanceRequest | None = None) -> Response:
        """Moves expert weights to a placement planned from the recent load, while serving."""
        body = body or RebalanceRequest()
        try:
            res = await engine.call(lambda eng: eng.rebalance(slots_per_worker=body.slots_per_worker,
                                                              planner=body.planner))
        except ConfigError as e:  # e.g. a deployment without expert workers
            return ApiError(400, str(e)).response()
        except (AfdServeError, ValueError) as e:
            return ApiError(409, str(e), code="rebalance_failed").response()
        return JSONResponse(RebalanceResponse(version=res.version,
                                              experts_per_worker=res.experts_per_worker).model_dump())

    @app.get("/admin/expert-load")
    async def expert_load() -> Response:
        """The per-layer expert load snapshot (tokens per expert, co-activation) as JSON."""
        snap = await engine.call(lambda eng: eng.expert_load())
        if snap is None or snap.steps == 0:
            return ApiError(404, "no expert load recorded yet: serve some requests first").response()
        return Response(snap.to_json(), media_type="application/json")

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, with the one model this server serves as the ``model`` enum."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schemas = schema["components"]["schemas"]
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                schemas[name]["properties"]["model"]["enum"] = [model_name]
            for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
                for option in schemas[name]["properties"]["model"]["anyOf"]:  # the name, or null
                    if option.get("type") == "string":
                        option["enum"] = [model_name]
            schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = engine.vocab_size - 1
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
