"""The audit log: who did what to which resource, and why."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import AuditEntry


def record(
    session: Session, actor: str, action: str, target: str, detail: dict[str, Any] | None = None
) -> None:
    session.add(AuditEntry(actor=actor, action=action, target=target, detail=detail or {}))


def entries(
    session: Session, *, target: str | None = None, limit: int = 100, offset: int = 0
) -> list[AuditEntry]:
    q = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit).offset(offset)
    if target is not None:
        q = q.where(AuditEntry.target == target)
    return list(session.scalars(q))
