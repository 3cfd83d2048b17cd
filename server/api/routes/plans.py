"""A job's batch plans: the current one (polled by workers) and the history."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from fastapi import APIRouter, Query, Response
from sqlalchemy.orm import Session, sessionmaker

from contract.agent import PlanOut
from contract.api import ModelOut, Page
from contract.base import MAX_PLAN_WAIT_S
from server.api.bodies import JSONRoute
from server.api.deps import Context, JobReader, PagingDep, PathId, SessionDep, Viewer
from server.context import AppContext
from server.notify import RECHECK_S
from server.services import jobs, memory, plans, rebalancer

router = APIRouter(prefix="/jobs", tags=["plans"], route_class=JSONRoute)


@router.get(
    "/{job_id}/plan",
    response_model=PlanOut,
    responses={304: {"description": "The plan is still `known_version` (after `wait_s`)."}},
)
async def current_plan(
    context: Context,
    _: JobReader,
    job_id: PathId,
    known_version: int | None = Query(None, ge=0, le=2**31 - 1),
    wait_s: float = Query(
        0.0,
        ge=0.0,
        le=MAX_PLAN_WAIT_S,
        description="With `known_version`: hold the request up to this many seconds until a "
        "newer plan is committed (a long-poll), then answer it, or 304 when none came.",
    ),
) -> Response:
    """The plan in force; with `known_version` equal to it, an empty 304, at once or, with
    `wait_s`, as soon as a newer plan exists (then 200) or after `wait_s` (then 304).

    Workers poll this, so it is served from a cache that the commit of a new plan clears (in
    this process at once, in the others over the plan bus, ``server.notify``); only a miss
    touches the database, once per job however many requests miss together."""
    version, body = await _current(context, job_id)
    if known_version is None or version != known_version:
        return Response(body, media_type="application/json")
    if wait_s > 0:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        waiters = context.plan_waiters
        while not waiters.closed and (remaining := deadline - loop.time()) > 0:
            changed = waiters.event(job_id)  # taken before the read, so no commit slips between
            version, body = await _current(context, job_id)
            if version != known_version:
                return Response(body, media_type="application/json")
            with contextlib.suppress(TimeoutError):  # re-read even if a notification was lost
                await asyncio.wait_for(changed.wait(), min(remaining, RECHECK_S))
    return Response(status_code=304)


async def _current(context: AppContext, job_id: int) -> tuple[int, bytes]:
    """The cached (version, body) of the job's current plan. Misses of different jobs share
    one read, on the cache's own thread, and a plan still polled is read again ahead of its
    expiry, so a long-poll's re-checks never wait for a read (``cache.PLAN_REFRESH_AFTER_S``)."""
    sessions, cache = context.sessions, context.caches.plans
    return await cache.get_or_load_batched(
        job_id, lambda job_ids: _load_current(sessions, job_ids, cache.get)
    )


def _load_current(
    sessions: sessionmaker[Session],
    job_ids: list[int],
    cached: Callable[[int], tuple[int, bytes] | None] = lambda _: None,
) -> dict[int, tuple[int, bytes] | Exception]:
    """Each job's (version, body), or why it has none. A refresh finds most plans as they
    were (200 jobs' plans are read again every few seconds, and change a few times a job):
    the versions of the jobs ``cached`` holds are read first (none held: no such read), and a
    plan still at its cached version keeps its body, neither read nor encoded again (a plan's
    rows, validated and encoded each refresh, were a twentieth of the fleet bench's API
    process)."""
    out: dict[int, tuple[int, bytes] | Exception] = {}
    held = {job_id: hit for job_id in job_ids if (hit := cached(job_id)) is not None}
    with sessions() as session:
        versions = plans.current_versions(session, held) if held else {}
        to_read = []
        for job_id in job_ids:
            hit = held.get(job_id)
            if hit is not None and versions.get(job_id) == hit[0]:
                out[job_id] = hit
            else:
                to_read.append(job_id)
        if to_read:
            for job_id, plan in plans.current_many(session, to_read).items():
                out[job_id] = (
                    plan
                    if isinstance(plan, Exception)
                    else (plan.version, PlanOut.model_validate(plan).model_dump_json().encode())
                )
    return out


@router.get("/{job_id}/models")
def worker_models(
    session: SessionDep, _: Viewer, job_id: PathId, paging: PagingDep
) -> Page[ModelOut]:
    """Each worker's performance model, fitted from its recent telemetry; by rank."""
    job = jobs.get(session, job_id)
    out = []
    mem = memory.ranks(session, job)
    sizes = plans.current(session, job.id).batch_sizes if job.plan_version else []
    for rank, fit in enumerate(rebalancer.fits(session, job)):
        model = None if fit is None else (fit.model or fit.guess)
        out.append(
            ModelOut(
                rank=rank,
                identifiable=bool(fit and fit.identifiable),
                per_sample_ms=model.per_sample_ms if model else None,
                intercept_ms=model.intercept_ms if model else None,
                floor_ms=model.floor_ms if model else None,
                r2=fit.r2 if fit else None,
                relative_rmse=fit.relative_rmse if fit else None,
                observations=fit.observations if fit else 0,
                distinct_batch_sizes=fit.distinct_batch_sizes if fit else 0,
                reason=fit.reason if fit else "no iteration with samples reported yet",
                **_memory_fields(mem[rank], sizes[rank] if rank < len(sizes) else 0),
            )
        )
    items, total = paging.slice(out)
    return Page(items=items, total=total)


def _memory_fields(m: memory.RankMemory, batch: int) -> dict[str, object]:
    model = m.fit.usable if m.fit else None
    return {
        "memory_cap": m.cap,
        "device_memory_mb": m.device_mb,
        "memory_base_mb": model.base_mb if model else None,
        "memory_per_sample_mb": model.per_sample_mb if model else None,
        "memory_identifiable": bool(m.fit and m.fit.identifiable),
        "memory_max_relative_error": m.fit.max_relative_error if m.fit else None,
        "predicted_memory_mb": m.predict(batch),
        "oom_batch": m.oom_batch,
        "memory_reason": m.fit.reason if m.fit else "no peak memory reported (not measured)",
    }


@router.get("/{job_id}/plans")
def plan_history(
    session: SessionDep,
    _: Viewer,
    job_id: PathId,
    paging: PagingDep,
) -> Page[PlanOut]:
    """Every plan version, newest first, with why it was made."""
    rows, total = plans.history(session, job_id, paging)
    return Page(items=[PlanOut.model_validate(p) for p in rows], total=total)
