"""Checkpoints jobs report: recorded as a rank writes them, listed for people and the CLI.

The files live where the job's spec put them (``agent.runtime.checkpoint``); the control plane
keeps only what was written, when, by which rank of which attempt, and how large it is. The
newest one a job reported is where a restart expects it to resume
(``server.services.jobs.restart``)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.agent import CheckpointReport
from server.models import Checkpoint
from server.services import jobs, rank_reports
from server.services.paging import Paging, page
from server.services.tokens import Principal


def report(
    session: Session, job_id: int, body: CheckpointReport, principal: Principal, now: datetime
) -> Checkpoint:
    """Record a checkpoint: a rank's own credential (or its host's agent, or an admin)."""
    job = jobs.get(session, job_id)
    rank_reports.check_may_write_ranks(
        session, principal, job_id, [body.rank], "report checkpoints"
    )
    row = Checkpoint(
        job_id=job.id,
        attempt=job.attempt,
        rank=body.rank,
        iteration=body.iteration,
        size_bytes=body.size_bytes,
        url=body.url,
        write_ms=body.write_ms,
        created_at=now,
    )
    session.add(row)
    session.flush()
    return row


def list_for(session: Session, job_id: int, paging: Paging) -> tuple[list[Checkpoint], int]:
    """A page of a job's checkpoints, newest first."""
    jobs.get(session, job_id)
    query = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.iteration.desc(), Checkpoint.id.desc())
    )
    return page(session, query, paging)
