"""What a job left: its ranks report their output files, people list them (the bytes travel
through ``artifact_content``)."""

from __future__ import annotations

from fastapi import APIRouter

from contract.agent import ArtifactReport
from contract.api import ArtifactOut, Page
from server.api.bodies import JSONRoute
from server.api.deps import Authenticated, JobReader, Now, PagingDep, PathId, SessionDep
from server.services import artifacts

router = APIRouter(prefix="/jobs", tags=["artifacts"], route_class=JSONRoute)


@router.post("/{job_id}/artifacts", status_code=201)
def report_artifact(
    body: ArtifactReport, session: SessionDep, principal: Authenticated, now: Now, job_id: PathId
) -> ArtifactOut:
    """Record a file a rank left in its output directory, or its final model (the rank's own
    credential, its host's agent, or an admin)."""
    return artifacts.report(session, job_id, body, principal, now)


@router.get("/{job_id}/artifacts")
def list_artifacts(
    session: SessionDep, _: JobReader, job_id: PathId, paging: PagingDep
) -> Page[ArtifactOut]:
    """A job's artifacts: name, size, where each is, and whether the server holds a copy."""
    items, total = artifacts.list_for(session, job_id, paging)
    return Page(items=items, total=total)
