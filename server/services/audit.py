"""The audit log: who did what to which resource, and why."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import AuditEntry
from server.services.paging import Paging, page


def record(
    session: Session, actor: str, action: str, target: str, detail: dict[str, Any] | None = None
) -> None:
    session.add(AuditEntry(actor=actor, action=action, target=target, detail=detail or {}))


def entries(
    session: Session, paging: Paging, *, target: str | None = None
) -> tuple[list[AuditEntry], int]:
    """A page of the log, newest first (only ``target``'s entries when given)."""
    q = select(AuditEntry).order_by(AuditEntry.id.desc())
    if target is not None:
        q = q.where(AuditEntry.target == target)
    return page(session, q, paging)
