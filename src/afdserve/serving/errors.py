"""Errors as OpenAI reports them: a status code and ``{"error": {"message", "type", "param", "code"}}``;
``install_error_handlers`` makes every error of an app (validation, HTTP, unexpected) one of these."""

from __future__ import annotations

import json
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from afdserve.serving.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class SafeJSONResponse(JSONResponse):
    """JSON that renders any string, even one with a lone surrogate (escaped as ``\\udXXX``)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class ApiError(Exception):
    """An error to answer with; ``retry_after`` (seconds) adds a Retry-After header."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return SafeJSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()


def validation_error(errors: Sequence[Any]) -> ApiError:
    """A 400 for FastAPI's RequestValidationError (pydantic errors of the JSON body)."""
    if not errors:
        return ApiError(400, "invalid request")
    err = errors[0]
    kind = err.get("type", "")
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if loc and isinstance(loc[0], str) and loc[0][:1].isupper():  # the member of a union body, e.g. /tokenize's
        loc = loc[1:]
    if kind == "json_invalid":
        return ApiError(400, "We could not parse the JSON body of your request. (HINT: This likely means you "
                        "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
                        code="invalid_json")
    param = _param(loc)
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if not loc:
        return ApiError(400, f"The request body must be a JSON object: {err.get('msg', 'invalid body')}",
                        code="invalid_body")
    value = err.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return ApiError(400, f"Invalid value for '{param}': {err.get('msg', 'invalid')} (got {shown}).", param=param,
                    code="invalid_value")


_NESTED_FIELDS = {"include_usage", "type", "text", "role", "content", "name", "tool_calls", "tool_call_id", "id",
                  "function", "arguments", "description", "parameters", "strict"}


def _param(loc: list[Any]) -> str:
    """``messages[0].content`` from a pydantic location (union member tags are dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif part in _NESTED_FIELDS:
            out += f".{part}"
        else:
            break  # a union member such as 'str' or 'list[int]': the location is precise enough
    return out
