"""The gate: what every HTTP request passes before the app reads a byte of its body.

A pure ASGI middleware (``Gate``), so nothing is parsed for a caller who may not call. It
answers nothing itself but refusals: what a request asks for is its route's (the fleet's
heartbeats and telemetry posts too, ``server.api.raw``).

1. **Cross-site writes.** An unsafe request (POST, PUT, PATCH, DELETE) that a browser could
   send on its own (it carries the session cookie, or it is ``/login`` or ``/logout``) must
   come from this server's own origin: its ``Origin`` header (or, without one, its
   ``Referer``) names the scheme, host and port the request was sent to, or one of
   ``Settings.allowed_origins`` (a reverse proxy's public origin). Neither header: refused.
   SameSite=Strict does not cover a page on another port of the same host (a notebook,
   TensorBoard), which is *same-site*; the Origin check does. Requests with an
   ``Authorization: Bearer`` header skip it: a cross-site page cannot set that header.
2. **Authentication.** Every API route but health needs a credential (a Bearer token, else
   the session cookie); it is checked from the headers alone, so an unauthenticated 8 MB
   post is answered 401 without being read. The principal goes into the request's state,
   where ``server.api.deps`` takes it.
3. **Bad-token throttling.** A client address whose credentials failed ``auth_failures_max``
   times within ``auth_failures_window_s`` gets 429 with ``Retry-After`` for further bad
   credentials; a valid credential from that address still works (a NAT or proxy shares
   one address among many users). ``/login`` counts against the same limit.
4. **Body size.** A ``Content-Length`` over the path's limit: 413 at once. A chunked body is
   counted as the app reads it and refused (413) at the limit, not after it is all read.
   (FastAPI's own ``max_body_size`` answers a declared length in plain text, not
   ``ErrorOut``, so the limit lives here.)
Refusals carry the one ``ErrorOut`` body. A request the database cannot serve (it is down,
refusing connections, or its pool is exhausted) gets 503 with ``Retry-After``
(:func:`database_unavailable`), here and in the app, never a 500: agents and the telemetry relay
retry what is not refused for good.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.base import ErrorOut
from server.context import AppContext
from server.errors import Unauthorized
from server.services import tokens
from server.services.tokens import Principal

SESSION_COOKIE = "evenflow_session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SESSION_PATHS = frozenset({"/login", "/logout"})
PRINCIPAL_STATE = "principal"
"""Where the gate leaves the caller's ``Principal`` in ``scope["state"]``."""


log = logging.getLogger("evenflow.gate")

DATABASE_DOWN: tuple[type[Exception], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
)
"""What the database raises when it cannot serve a request now: connections refused or lost,
a busy SQLite file, a deadlock, no pooled connection free in time."""
RETRY_AFTER_S = 5


def database_unavailable(exc: Exception) -> JSONResponse:
    """503 with ``Retry-After`` for a request the database could not serve (``DATABASE_DOWN``);
    the driver's message goes to the log, not to the caller."""
    log.warning("the database could not serve a request: %s", str(exc).splitlines()[0])
    return error_response(
        503,
        f"the database is unavailable or busy; try again in {RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def error_response(
    status: int,
    detail: str,
    field: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The one error body (``ErrorOut``) every 4xx carries."""
    body = ErrorOut(detail=detail, field=field, errors=errors).model_dump(exclude_none=True)
    return JSONResponse(body, status_code=status, headers=headers)


class Gate:
    """See the module docstring. ``public`` are API paths anyone may call (health)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        context: AppContext,
        api_prefix: str,
        public: frozenset[str],
        max_body: int,
        body_limits: Mapping[str, int],
        body_limit_patterns: Sequence[tuple[re.Pattern[str], int]] = (),
    ) -> None:
        self.app, self.context = app, context
        self.api_prefix, self.public = api_prefix + "/", public
        self.max_body, self.body_limits = max_body, body_limits
        self.body_limit_patterns = body_limit_patterns
        """Limits of paths with ids in them (an artifact's upload), by pattern."""
        settings = context.settings
        self.allowed_origins = frozenset(_origin(o) for o in settings.allowed_origins)
        self.failures = context.auth_failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The gate's own read of the database is the credential's; what it passes on, the
        # app's handlers answer (503 for the same errors).
        try:
            refusal = await self._refusal(scope)
        except DATABASE_DOWN as exc:
            refusal = database_unavailable(exc)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        limit = self._limit(scope["path"])
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # FastAPI passes an HTTPException through to the app's handler
                raise HTTPException(413, f"request body over {limit} bytes")
            return message

        await self.app(scope, counted, send)

    def _limit(self, path: str) -> int:
        """The most bytes a request's body to ``path`` may have."""
        found = self.body_limits.get(path)
        if found is not None:
            return found
        for pattern, limit in self.body_limit_patterns:
            if pattern.fullmatch(path):
                return limit
        return self.max_body

    async def _refusal(self, scope: Scope) -> JSONResponse | None:
        headers = Headers(scope=scope)
        bearer = bearer_token(headers)
        cookie = cookie_parser(headers.get("cookie", "")).get(SESSION_COOKIE) or None
        path: str = scope["path"]
        browser_write = scope["method"] not in SAFE_METHODS and bearer is None
        if browser_write and (cookie is not None or path in SESSION_PATHS):
            problem = cross_origin(scope, headers, self.allowed_origins)
            if problem is not None:
                return error_response(403, f"cross-origin request refused: {problem}")
        if path.startswith(self.api_prefix) and path not in self.public:
            try:
                secret = tokens.require_secret(bearer or cookie)
                principal = await authenticate(self.context, secret)
            except Unauthorized as exc:
                return self._failed(scope, exc, presented=(bearer or cookie) is not None)
            scope.setdefault("state", {})[PRINCIPAL_STATE] = principal
        return self._too_large(path, headers)

    def _too_large(self, path: str, headers: Headers) -> JSONResponse | None:
        """413 for a declared ``Content-Length`` over the path's limit (a chunked body is
        counted as the app reads it)."""
        declared = headers.get("content-length", "")
        limit = self._limit(path)
        if declared.isdigit() and int(declared) > limit:
            return error_response(413, f"request body over {limit} bytes")
        return None

    def _failed(self, scope: Scope, exc: Unauthorized, *, presented: bool) -> JSONResponse:
        """401, or 429 with ``Retry-After`` once the address has sent too many bad
        credentials (a request with none does not count)."""
        if not presented:
            return error_response(401, exc.message)
        address = (scope.get("client") or ("unknown", 0))[0]
        retry_after = self.failures.fail(address)
        if retry_after is None:
            return error_response(401, exc.message)
        return error_response(
            429,
            self.failures.message(address, retry_after),
            headers={"Retry-After": str(retry_after)},
        )


async def authenticate(context: AppContext, secret: str) -> Principal:
    """The principal of ``secret``: from the token cache, else one batched read in a worker
    thread with every other miss in flight; raises ``Unauthorized``."""
    sessions = context.sessions
    principal: Principal = await context.caches.tokens.get_or_load_batched(
        tokens.cache_key(secret), lambda keys: tokens.authenticate_keys(sessions, keys)
    )
    return principal


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer`` header (what ``HTTPBearer`` reads), or None."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


def cross_origin(scope: Scope, headers: Headers, allowed: frozenset[str]) -> str | None:
    """Why the request's origin is not this server's (None when it is)."""
    origin = headers.get("origin")
    if origin is None:
        referer = headers.get("referer")
        if not referer:
            return "no Origin or Referer header"
        origin = referer
    source = _origin(origin)
    own = _origin(f"{scope.get('scheme', 'http')}://{_host(scope, headers)}")
    if source == own or source in allowed:
        return None
    return f"origin {origin[:200]!r} is not {own!r}"


def _host(scope: Scope, headers: Headers) -> str:
    host = headers.get("host")
    if host:
        return host
    server = scope.get("server") or ("localhost", None)
    return server[0] if server[1] is None else f"{server[0]}:{server[1]}"


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url``, lower-case, without a default port; "" for a URL
    without both (``null``, a path)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return ""
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if not scheme or not host:
        return ""
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == _DEFAULT_PORTS.get(scheme):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"
