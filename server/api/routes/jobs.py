"""Jobs: submit, list, inspect, cancel; the rendezvous port its ranks meet on."""

from __future__ import annotations

from fastapi import APIRouter, Query

from contract.agent import RendezvousIn, RendezvousOut
from contract.api import JobOut, Page, RankLogOut
from contract.enums import JobStatus
from contract.spec import JobSpec
from server.api.bodies import JSONRoute
from server.api.deps import (
    Authenticated,
    JobReader,
    Now,
    Operator,
    PagingDep,
    PathId,
    SessionDep,
    Viewer,
)
from server.api.statuses import declare
from server.services import jobs, rendezvous

router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=JSONRoute)


@router.post("", status_code=201)
def create_job(spec: JobSpec, session: SessionDep, principal: Operator, now: Now) -> JobOut:
    """Submit a job; it is placed on free devices at once or waits as pending."""
    return JobOut.model_validate(jobs.create(session, spec, principal, now))


@router.get("")
def list_jobs(
    session: SessionDep,
    _: Viewer,
    paging: PagingDep,
    status: JobStatus | None = None,
) -> Page[JobOut]:
    """Jobs, newest first."""
    rows, total = jobs.list_jobs(session, status=status, limit=paging.limit, offset=paging.offset)
    return Page(items=[JobOut.model_validate(j) for j in rows], total=total)


@router.get("/{job_id}")
def get_job(session: SessionDep, _: JobReader, job_id: PathId) -> JobOut:
    """One job with its workers."""
    return JobOut.model_validate(jobs.get(session, job_id))


@router.get("/{job_id}/logs")
def get_logs(
    session: SessionDep,
    _: JobReader,
    job_id: PathId,
    paging: PagingDep,
    rank: int | None = Query(None, ge=0, le=10_000),
) -> Page[RankLogOut]:
    """Each rank's (or one rank's) root cause and the last lines of its log, uploaded by its
    agent when it ended (and, while the logs are followed, as a running rank's log grows);
    by rank."""
    ranks, total = paging.slice(jobs.logs(session, job_id, rank))
    return Page(items=[RankLogOut.model_validate(w) for w in ranks], total=total)


@router.post("/{job_id}/logs/follow")
def follow_logs(
    session: SessionDep,
    _: JobReader,
    now: Now,
    job_id: PathId,
    paging: PagingDep,
    rank: int | None = Query(None, ge=0, le=10_000),
) -> Page[RankLogOut]:
    """``GET .../logs``, and the job's running ranks' live log tails uploaded by their agents
    for the next 30 s (call it again within that to keep them coming): what ``jobs logs
    --follow`` polls. Changes nothing of the job but that."""
    ranks, total = paging.slice(jobs.follow_logs(session, job_id, rank, now))
    return Page(items=[RankLogOut.model_validate(w) for w in ranks], total=total)


@router.post("/{job_id}/cancel", responses=declare(409))
def cancel_job(session: SessionDep, principal: Operator, now: Now, job_id: PathId) -> JobOut:
    """Cancel a job that has not ended; its agents stop the workers."""
    return JobOut.model_validate(jobs.cancel(session, job_id, principal, now))


@router.get("/{job_id}/rendezvous", responses=declare(409))
def get_rendezvous(session: SessionDep, _: JobReader, job_id: PathId) -> RendezvousOut:
    """Rank 0's address and rendezvous port (null until rank 0 has bound one)."""
    return rendezvous.lookup(session, job_id)


@router.put("/{job_id}/rendezvous", responses=declare(409))
def put_rendezvous(
    body: RendezvousIn, session: SessionDep, principal: Authenticated, job_id: PathId
) -> RendezvousOut:
    """Rank 0's worker publishes the port it bound (its own credential only)."""
    return rendezvous.publish(session, job_id, body, principal)
