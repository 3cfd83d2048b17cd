"""Request dependencies as ``Annotated`` aliases, so route signatures read like sentences."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from contract.base import MAX_ID
from contract.enums import Role
from server.api.gate import PRINCIPAL_STATE, SESSION_COOKIE, authenticate
from server.config import Settings
from server.context import AppContext, context_of
from server.services import tokens
from server.services.paging import DEFAULT_LIMIT, MAX_LIMIT, MAX_OFFSET, Paging
from server.services.tokens import Principal

log = logging.getLogger(__name__)

_bearer = HTTPBearer(
    auto_error=False, description="An Evenflow API token (`evenflow tokens create`)."
)


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def _context(request: Request) -> AppContext:
    return context_of(request.app)


Context = Annotated[AppContext, Depends(_context)]
"""The app's typed state (``server.context``): engine, sessions, caches, metrics, notifiers."""


async def _db_slot(context: Context) -> AsyncIterator[None]:
    """A slot of the app's bounded database work (``AppContext.db_slots``), awaited on the event
    loop, so a request that waits for one holds neither a worker thread nor a connection."""
    async with context.db_slots:
        yield


DbSlot = Annotated[None, Depends(_db_slot, scope="function")]


def _session(request: Request, context: Context, _slot: DbSlot) -> Iterator[Session]:
    """One transaction per request (``AppContext.transaction``), committed before the response
    is sent, inside a database slot held until the session is closed."""
    with context.transaction(write=request.method not in SAFE_METHODS) as session:
        yield session


SessionDep = Annotated[Session, Depends(_session, scope="function")]


async def _principal(
    request: Request,
    context: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, as ``server.api.gate`` found it before the body was read (every API route
    passes the gate). Outside the gate, the same check here: a Bearer token, else the session
    cookie, from the token cache (``server.scale.cache``) or one batched read on its own thread."""
    found = request.scope.get("state", {}).get(PRINCIPAL_STATE)
    if isinstance(found, Principal):
        return found
    cookie = request.cookies.get(SESSION_COOKIE)
    secret = credentials.credentials if credentials is not None else cookie
    return await authenticate(context, tokens.require_secret(secret))


def _role(role: Role) -> object:
    async def check(principal: Annotated[Principal, Depends(_principal)]) -> Principal:
        principal.require(role)
        return principal

    return Depends(check)


Viewer = Annotated[Principal, _role(Role.VIEWER)]
Operator = Annotated[Principal, _role(Role.OPERATOR)]
Admin = Annotated[Principal, _role(Role.ADMIN)]
Authenticated = Annotated[Principal, Depends(_principal)]
"""Any valid token; the route checks finer rights itself (agents writing for their host)."""


async def _job_reader(
    principal: Annotated[Principal, Depends(_principal)],
    job_id: Annotated[int, Path(ge=1, le=MAX_ID)],
) -> Principal:
    principal.require_job_reader(job_id)
    return principal


JobReader = Annotated[Principal, Depends(_job_reader)]
"""A viewer, or the worker credential of the job in the path (its plan and spec)."""


async def _settings(context: Context) -> Settings:
    return context.settings


SettingsDep = Annotated[Settings, Depends(_settings)]


PathId = Annotated[int, Path(ge=1, le=MAX_ID)]
"""A job's, host's or token's id in a route's path."""


async def _now() -> datetime:
    return datetime.now(UTC)


Now = Annotated[datetime, Depends(_now)]


def _paging(
    limit: Annotated[
        int, Query(ge=1, le=MAX_LIMIT, description=f"Items in the page (at most {MAX_LIMIT}).")
    ] = DEFAULT_LIMIT,
    offset: Annotated[
        int, Query(ge=0, le=MAX_OFFSET, description="Items skipped before the page.")
    ] = 0,
) -> Paging:
    return Paging(limit=limit, offset=offset)


PagingDep = Annotated[Paging, Depends(_paging)]
"""``limit`` and ``offset`` of every list endpoint (which answers a ``Page``): one page of at
most ``MAX_LIMIT`` items; a larger ``limit`` is a 422 naming ``limit``."""
