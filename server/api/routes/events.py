"""Straggler events and manual overrides of a job."""

from __future__ import annotations

from fastapi import APIRouter, Response

from contract.api import EventOut, OverrideCreate, OverrideOut, Page
from contract.enums import OverrideKind
from server.api.bodies import JSONRoute
from server.api.deps import Operator, PagingDep, PathId, SessionDep, Viewer
from server.api.statuses import declare
from server.services import events, jobs, overrides

router = APIRouter(prefix="/jobs", tags=["events"], route_class=JSONRoute)


@router.get("/{job_id}/events")
def list_events(
    session: SessionDep, _: Viewer, job_id: PathId, paging: PagingDep
) -> Page[EventOut]:
    """Straggler events of a job, newest first."""
    jobs.get(session, job_id)
    rows, total = events.list_events(session, job_id, paging)
    return Page(items=[EventOut.model_validate(e) for e in rows], total=total)


@router.get("/{job_id}/overrides")
def list_overrides(
    session: SessionDep, _: Viewer, job_id: PathId, paging: PagingDep
) -> Page[OverrideOut]:
    """Overrides applied to a job, newest first."""
    jobs.get(session, job_id)
    rows, total = overrides.list_overrides(session, job_id, paging)
    return Page(
        items=[OverrideOut.model_validate({**_row(o), "kind": OverrideKind(o.kind)}) for o in rows],
        total=total,
    )


@router.post(
    "/{job_id}/overrides",
    status_code=201,
    responses={
        200: {"model": OverrideOut, "description": "A preview: nothing was created"},
        **declare(409),
    },
)
def create_override(
    req: OverrideCreate,
    session: SessionDep,
    principal: Operator,
    job_id: PathId,
    response: Response,
) -> OverrideOut:
    """Preview (`preview: true`, 200) or apply (201) an override; workers take an applied one at
    the next iteration."""
    out = overrides.submit(session, jobs.get(session, job_id), req, principal)
    if req.preview:
        response.status_code = 200
    return out


def _row(o: object) -> dict[str, object]:
    return {
        k: getattr(o, k)
        for k in ("id", "job_id", "reason", "payload", "created_by", "created_at", "applied")
    }
