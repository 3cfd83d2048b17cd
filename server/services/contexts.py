"""Code archives uploaded for jobs (blobs, ``server.services.blobs``): who may upload and read
them, and which a job may name.

Operators upload and read archives; an agent reads those of the jobs placed on its host.
"""

from __future__ import annotations

from datetime import datetime
from typing import IO, TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.api import ContextOut
from contract.enums import Role
from server.errors import Forbidden, Invalid, NotFound
from server.models import Blob, Host, Job, Worker
from server.services import blobs
from server.services.audit import record
from server.services.tokens import Principal

if TYPE_CHECKING:
    from server.context import AppContext


def store(
    app: AppContext, spool: IO[bytes], sha256: str, size: int, principal: Principal, now: datetime
) -> ContextOut:
    """Store an archive (its bytes hash to ``sha256``) unless it is there already."""
    row, new = blobs.store(app, spool, sha256, size, principal.name, now)
    if new:
        with app.transaction(write=True) as session:
            record(session, principal.name, "context.upload", f"context:{sha256}", {"bytes": size})
    return _out(row, new=new)


def info(session: Session, sha256: str, principal: Principal) -> ContextOut:
    """The archive's size and origin (404 when there is none: upload it first)."""
    return _out(_readable(session, sha256, principal), new=False)


def check_readable(session: Session, sha256: str, principal: Principal) -> None:
    """404 when no such archive exists; 403 unless the caller may read it."""
    _readable(session, sha256, principal)


def require(session: Session, sha256: str) -> None:
    """A job may name only an archive that was uploaded (422 naming ``workload.context``)."""
    if session.get(Blob, sha256) is None:
        raise Invalid(
            f"no context with sha256 {sha256} was uploaded: upload it first "
            "(evenflow jobs submit --context DIR does both)",
            field="workload.context",
        )


def _readable(session: Session, sha256: str, principal: Principal) -> Blob:
    row = session.get(Blob, sha256)
    if row is None:
        raise NotFound(f"no context with sha256 {sha256}", field="sha256")
    if principal.role is Role.AGENT:
        placed = session.scalar(
            select(Worker.id)
            .join(Job, Worker.job_id == Job.id)
            .join(Host, Worker.host_id == Host.id)
            .where(Job.context == sha256, Host.name == principal.host)
            .limit(1)
        )
        if placed is None:
            raise Forbidden(
                f"agent '{principal.host}' runs no job of context {sha256[:12]}",
                field="sha256",
            )
        return row
    principal.require(Role.OPERATOR)
    return row


def _out(row: Blob, *, new: bool) -> ContextOut:
    return ContextOut(
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        created_by=row.created_by,
        new=new,
    )
