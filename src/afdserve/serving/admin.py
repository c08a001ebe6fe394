"""The admin endpoints (``/admin/rebalance``, ``/admin/scale``, ``/admin/expert-load``): off the public API unless the
server has an admin token (then on it, behind ``Authorization: Bearer``), or on their own listener
bound to 127.0.0.1 (``create_admin_app``, ``--admin-port``), which shares the public server's
``AsyncEngine`` and event loop."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from afdserve.errors import AfdServeError, ConfigError
from afdserve.serving.async_engine import AsyncEngine
from afdserve.serving.edge import DEFAULT_MAX_BODY_BYTES, RequestGuard, admin_auth
from afdserve.serving.errors import ApiError, install_error_handlers
from afdserve.serving.protocol import ErrorResponse, RebalanceRequest, RebalanceResponse, ScaleRequest, ScaleResponse

_AUTH: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "no admin token"},
    403: {"model": ErrorResponse, "description": "a wrong admin token"},
}


def admin_router(engine: AsyncEngine, num_experts: int | None, token: str | None) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(admin_auth(token))] if token else [],
                       responses=_AUTH if token else {})

    @router.post("/rebalance", response_model=RebalanceResponse, responses={
        400: {"model": ErrorResponse, "description": "invalid request"},
        409: {"model": ErrorResponse, "description": "no placement now: no expert workers, no load yet, ..."},
        413: {"model": ErrorResponse, "description": "the body is too large"}})
    async def rebalance(body: RebalanceRequest | None = None) -> Response:
        """Moves expert weights to a placement planned from the recent load, while serving."""
        body = body or RebalanceRequest()
        slots = body.slots_per_worker
        if slots is not None and num_experts is not None and slots > num_experts:
            raise ApiError(400, f"Invalid value for 'slots_per_worker': the model has {num_experts} experts, so an "
                           f"expert worker holds at most {num_experts} (got {slots}).", param="slots_per_worker",
                           code="invalid_value")
        try:
            res = await engine.call(lambda eng: eng.rebalance(slots_per_worker=slots, planner=body.planner))
        except ConfigError as e:  # e.g. a deployment without expert workers
            raise ApiError(409, str(e), code="rebalance_unsupported") from e
        except (AfdServeError, ValueError) as e:
            raise ApiError(409, str(e), code="rebalance_failed") from e
        return JSONResponse(RebalanceResponse(version=res.version,
                                              experts_per_worker=res.experts_per_worker).model_dump())

    @router.post("/scale", response_model=ScaleResponse, responses={
        400: {"model": ErrorResponse, "description": "invalid request"},
        409: {"model": ErrorResponse, "description": "no resize now: no worker pools, a launcher that cannot start "
                                                     "workers, a failed deployment"},
        413: {"model": ErrorResponse, "description": "the body is too large"}})
    async def scale(body: ScaleRequest | None = None) -> Response:
        """Adds or removes attention and/or expert workers while serving (experts re-placed by the
        balance planner, a removed attention worker's requests moved); returns once every worker is up.
        Sizes left out stay as they are (an empty body changes nothing and says what runs)."""
        body = body or ScaleRequest()
        if body.expert_workers is not None and num_experts is not None and body.expert_workers > num_experts:
            raise ApiError(400, f"Invalid value for 'expert_workers': the model has {num_experts} experts, so at "
                           f"most {num_experts} expert workers (got {body.expert_workers}).", param="expert_workers",
                           code="invalid_value")
        try:
            res = await engine.call(lambda eng: eng.scale(body.attention_workers, body.expert_workers))
        except ConfigError as e:  # e.g. the colocated engine
            raise ApiError(409, str(e), code="scale_unsupported") from e
        except (AfdServeError, ValueError) as e:
            raise ApiError(409, str(e), code="scale_failed") from e
        return JSONResponse(ScaleResponse(**vars(res)).model_dump())

    @router.get("/expert-load", responses={
        200: {"content": {"application/json": {"schema": {"type": "object"}}}, "description": "the snapshot"},
        404: {"model": ErrorResponse, "description": "no load recorded yet"}})
    async def expert_load() -> Response:
        """The per-layer expert load snapshot (tokens per expert, co-activation) as JSON."""
        snap = await engine.call(lambda eng: eng.expert_load())
        if snap is None or snap.steps == 0:
            raise ApiError(404, "no expert load recorded yet: serve some requests first", code="no_expert_load")
        return Response(snap.to_json(), media_type="application/json")

    return router


def limit_admin_schema(schema: dict[str, Any], num_experts: int | None) -> None:
    """``slots_per_worker``'s and ``expert_workers``' maximum in ``schema``: the model's number of experts."""
    schemas = schema.get("components", {}).get("schemas", {})
    for model, prop in (("RebalanceRequest", "slots_per_worker"), ("ScaleRequest", "expert_workers")):
        props = schemas.get(model, {}).get("properties", {})
        if num_experts is not None and prop in props:
            for option in props[prop]["anyOf"]:
                if option.get("type") == "integer":
                    option["maximum"] = min(num_experts, option.get("maximum", num_experts))


def create_admin_app(engine: AsyncEngine, num_experts: int | None, token: str | None = None,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The admin endpoints alone (for a listener on 127.0.0.1); the public app starts and stops the engine."""
    app = FastAPI(title="afdserve admin", version=version("afdserve"),
                  description="Admin endpoints of an afdserve deployment")
    install_error_handlers(app)
    app.include_router(admin_router(engine, num_experts, token))
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            limit_admin_schema(schema, num_experts)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
