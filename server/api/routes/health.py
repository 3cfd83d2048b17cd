"""Liveness without a token."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import text

from contract.base import PROTOCOL_VERSION
from server.api.bodies import JSONRoute
from server.api.deps import SessionDep

router = APIRouter(tags=["health"], route_class=JSONRoute)


class Health(BaseModel):
    status: str
    protocol_version: int
    database: str


class Liveness(BaseModel):
    status: str


@router.get("/health/live")
def live() -> Liveness:
    """Is the process answering (no database access: for liveness probes)."""
    return Liveness(status="ok")


@router.get("/health")
def health(session: SessionDep) -> Health:
    """Is the server up and its database reachable."""
    session.execute(text("SELECT 1"))
    return Health(
        status="ok", protocol_version=PROTOCOL_VERSION, database=session.get_bind().dialect.name
    )
