"""The audit log."""

from __future__ import annotations

from fastapi import APIRouter, Query

from contract.api import AuditOut
from server.api.bodies import JSONRoute
from server.api.deps import SessionDep, Viewer
from server.services import audit

router = APIRouter(prefix="/audit", tags=["audit"], route_class=JSONRoute)


@router.get("")
def audit_log(
    session: SessionDep,
    _: Viewer,
    target: str | None = Query(None, max_length=128, pattern=r"^[\w:.-]+$"),
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=2**31 - 1),
) -> list[AuditOut]:
    """Who did what, newest first; `target` like `job:3` narrows it."""
    return [
        AuditOut.model_validate(e)
        for e in audit.entries(session, target=target, limit=limit, offset=offset)
    ]
