"""Request dependencies as ``Annotated`` aliases, so route signatures read like sentences."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated, cast

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from agent.wire import Role
from server.config import Settings
from server.services import tokens
from server.services.tokens import Principal

_bearer = HTTPBearer(
    auto_error=False, description="An Evenflow API token (`evenflow tokens create`)."
)


def _session(request: Request) -> Iterator[Session]:
    """One transaction per request, committed before the response is sent."""
    with request.app.state.sessions() as session, session.begin():
        yield session


SessionDep = Annotated[Session, Depends(_session, scope="function")]


def _principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    secret = (
        credentials.credentials
        if credentials is not None
        else request.cookies.get("evenflow_session")
    )
    with request.app.state.sessions() as session:
        return tokens.authenticate(session, secret)


def _role(role: Role) -> object:
    def check(principal: Annotated[Principal, Depends(_principal)]) -> Principal:
        principal.require(role)
        return principal

    return Depends(check)


Viewer = Annotated[Principal, _role(Role.VIEWER)]
Operator = Annotated[Principal, _role(Role.OPERATOR)]
Admin = Annotated[Principal, _role(Role.ADMIN)]
Authenticated = Annotated[Principal, Depends(_principal)]
"""Any valid token; the route checks finer rights itself (agents writing for their host)."""


def _settings(request: Request) -> Settings:
    return cast(Settings, request.app.state.settings)


SettingsDep = Annotated[Settings, Depends(_settings)]


def _now() -> datetime:
    return datetime.now(UTC)


Now = Annotated[datetime, Depends(_now)]
