"""A job's straggler events, as the API lists them."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import StragglerEvent


def list_events(session: Session, job_id: int, *, limit: int) -> list[StragglerEvent]:
    """The job's newest ``limit`` events, newest first."""
    return list(
        session.scalars(
            select(StragglerEvent)
            .where(StragglerEvent.job_id == job_id)
            .order_by(StragglerEvent.id.desc())
            .limit(limit)
        )
    )
