"""A job's straggler events, as the API lists them."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.models import IterationTelemetry, StragglerEvent
from server.services.paging import Paging, page


def list_events(session: Session, job_id: int, paging: Paging) -> tuple[list[StragglerEvent], int]:
    """A page of the job's events, newest first."""
    query = (
        select(StragglerEvent)
        .where(StragglerEvent.job_id == job_id)
        .order_by(StragglerEvent.id.desc())
    )
    return page(session, query, paging)


def close_open(session: Session, job_id: int, why: str = "job ended") -> int:
    """Close the job's events still open when it ends or restarts (the watch stops with the
    attempt: the next one starts a watch of its own, on other devices): each ends after the
    job's last reported iteration, closed by ``why``. Returns how many were closed."""
    rows = list(
        session.scalars(
            select(StragglerEvent).where(
                StragglerEvent.job_id == job_id, StragglerEvent.end_iteration.is_(None)
            )
        )
    )
    if not rows:
        return 0
    last = session.scalar(
        select(func.max(IterationTelemetry.iteration)).where(IterationTelemetry.job_id == job_id)
    )
    for row in rows:
        end = row.start_iteration + 1 if last is None else int(last) + 1
        row.end_iteration = max(end, row.start_iteration + 1)
        row.detail = {**(row.detail or {}), "closed_by": why}
    return len(rows)
