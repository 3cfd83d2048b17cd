"""Chart data for the dashboard: a job's downsampled telemetry and jobs' recent speed."""

from __future__ import annotations

from fastapi import APIRouter, Query

from contract.dashboard import SeriesOut, ThroughputOut
from server.api.bodies import JSONRoute
from server.api.deps import PathId, SessionDep, Viewer
from server.api.statuses import declare
from server.errors import Invalid
from server.services import jobs, series

router = APIRouter(tags=["dashboard"], route_class=JSONRoute)


@router.get("/jobs/{job_id}/series")
def job_series(
    session: SessionDep,
    _: Viewer,
    job_id: PathId,
    points: int = Query(500, ge=10, le=10_000),
    window: int = Query(20, ge=1, le=10_000),
) -> SeriesOut:
    """At most `points` points per worker, bucketed by iteration; resume the stream after `last_id`."""
    return series.downsampled(
        session, jobs.get(session, job_id), points=points, window_iterations=window
    )


@router.get("/dashboard/throughput", responses=declare(404))
def job_throughput(
    session: SessionDep,
    _: Viewer,
    ids: str = Query(..., max_length=2000, pattern=r"^\d{1,10}(,\d{1,10}){0,99}$"),
) -> list[ThroughputOut]:
    """Samples per second of each job in `ids` (comma-separated, at most 100) over its last 20 iterations."""
    out = []
    for i, raw in enumerate(ids.split(",")):
        job_id = int(raw)
        if not 1 <= job_id <= 2**31 - 1:
            raise Invalid(f"ids[{i}] is not a job id", field="ids")
        out.append(series.throughput(session, jobs.get(session, job_id)))
    return out
