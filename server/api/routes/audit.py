"""The audit log."""

from __future__ import annotations

from fastapi import APIRouter, Query

from contract.api import AuditOut, Page
from server.api.bodies import JSONRoute
from server.api.deps import PagingDep, SessionDep, Viewer
from server.services import audit

router = APIRouter(prefix="/audit", tags=["audit"], route_class=JSONRoute)


@router.get("")
def audit_log(
    session: SessionDep,
    _: Viewer,
    paging: PagingDep,
    target: str | None = Query(None, max_length=128, pattern=r"^[\w:.-]+$"),
) -> Page[AuditOut]:
    """Who did what, newest first; `target` like `job:3` narrows it."""
    rows, total = audit.entries(session, paging, target=target)
    return Page(items=[AuditOut.model_validate(e) for e in rows], total=total)
