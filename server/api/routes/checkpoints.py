"""Checkpoints: the ranks of a job report them, people list them."""

from __future__ import annotations

from fastapi import APIRouter

from contract.agent import CheckpointReport
from contract.api import CheckpointOut, Page
from server.api.bodies import JSONRoute
from server.api.deps import Authenticated, JobReader, Now, PagingDep, PathId, SessionDep
from server.services import checkpoints

router = APIRouter(prefix="/jobs", tags=["checkpoints"], route_class=JSONRoute)


@router.post("/{job_id}/checkpoints", status_code=201)
def report_checkpoint(
    body: CheckpointReport, session: SessionDep, principal: Authenticated, now: Now, job_id: PathId
) -> CheckpointOut:
    """Record a checkpoint a rank wrote (its own worker credential, its host's agent, or an
    admin)."""
    return CheckpointOut.model_validate(checkpoints.report(session, job_id, body, principal, now))


@router.get("/{job_id}/checkpoints")
def list_checkpoints(
    session: SessionDep,
    _: JobReader,
    job_id: PathId,
    paging: PagingDep,
) -> Page[CheckpointOut]:
    """A job's checkpoints, newest first: iteration, size, when, by which rank and attempt."""
    rows, total = checkpoints.list_for(session, job_id, paging)
    return Page(items=[CheckpointOut.model_validate(c) for c in rows], total=total)
