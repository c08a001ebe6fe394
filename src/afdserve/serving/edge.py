"""The server's edge: what every request body must be before an endpoint sees it, and who may call
the admin endpoints.

``RequestGuard`` (pure ASGI, so streams stay untouched) reads a request's body, up to
``max_body_bytes`` (more: 413, the rest is not read), and rejects text that is not Unicode with 400
``invalid_value``: bytes that are not UTF-8, and lone surrogates (``"\\ud800"`` in JSON), which
Python's JSON parser turns into strings that no tokenizer, template or encoder can take.
``admin_auth(token)`` is the admin endpoints' dependency: ``Authorization: Bearer <token>``, 401
without credentials, 403 with others.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any, Callable, Coroutine

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from afdserve.serving.errors import ApiError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
ADMIN_TOKEN_ENV = "AFDSERVE_ADMIN_TOKEN"
# In JSON text: an escaped backslash (skipped), a surrogate pair (fine) or a lone surrogate.
_ESCAPES = re.compile(rb"\\\\"  # \\
                      rb"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"  # \ud83d\ude00
                      rb"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # \ud800 alone
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class RequestGuard:
    """Pure ASGI middleware: bodies up to ``max_body_bytes``, in UTF-8, without lone surrogates."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await _too_large(limit)(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(limit)(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        error = not_unicode(body)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect

        await self.app(scope, replay, send)


def _too_large(limit: int) -> Response:
    return ApiError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large").response()


def not_unicode(body: bytes) -> ApiError | None:
    """A 400 if ``body`` is not UTF-8 or holds a lone surrogate escape (None if it is fine)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return ApiError(400, f"The request body is not valid UTF-8 (byte {e.start}).", code="invalid_value")
    if b"\\u" not in body or not any(len(m[0]) == 6 for m in _ESCAPES.finditer(body)):
        return None
    try:
        where = _surrogate_at(json.loads(body))
    except ValueError:
        return None  # not JSON: the endpoint says so
    if where is None:
        return None
    return ApiError(400, "Invalid Unicode: a lone surrogate (\\ud800-\\udfff) is not a character"
                    + (f" (in '{where}')." if where else "."), param=where or None, code="invalid_value")


def _surrogate_at(value: Any, path: str = "") -> str | None:
    """Where (``messages[0].content``; "" for the body itself) the first lone surrogate is, if any."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if _SURROGATE.search(k):
                return path
            found = _surrogate_at(v, f"{path}.{k}" if path else k)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate_at(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def admin_auth(token: str) -> Callable[..., Coroutine[Any, Any, None]]:
    """The dependency of the admin endpoints when they need ``token``."""
    bearer = HTTPBearer(auto_error=False, description=f"the server's admin token (--admin-token or ${ADMIN_TOKEN_ENV})")
    expected = token.encode()

    async def check(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None:
            raise ApiError(401, "The admin endpoints need 'Authorization: Bearer <admin token>'.",
                           code="missing_admin_token", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(creds.credentials.encode("utf-8", "surrogateescape"), expected):
            raise ApiError(403, "Invalid admin token.", code="invalid_admin_token")

    return check
