"""Plan versions of a job. Every stored plan sums to the job's global batch (invariant 1)."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from contract.enums import PlanSource
from server.errors import Invalid, NotFound
from server.models import Job, Plan
from server.scale.cache import mark_plan_changed
from server.services.paging import Paging, page


def equal_split(global_batch: int, n: int) -> list[int]:
    """B split as evenly as integers allow; the first ranks take the remainder."""
    q, r = divmod(global_batch, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def validate(job: Job, batch_sizes: list[int], field: str = "batch_sizes") -> None:
    spec = job.job_spec
    world = len(job.workers) if job.workers else (spec.workers or len(spec.devices or []))
    b = spec.global_batch
    if len(batch_sizes) != world:
        raise Invalid(f"{field} has {len(batch_sizes)} entries for {world} workers", field=field)
    if any(x < 0 for x in batch_sizes):
        raise Invalid(f"{field} must not be negative", field=field)
    if sum(batch_sizes) != b:
        raise Invalid(f"{field} sums to {sum(batch_sizes)}, the global batch is {b}", field=field)
    cap = spec.max_batch_per_worker
    if cap is not None and max(batch_sizes) > cap:
        raise Invalid(f"{field} exceeds max_batch_per_worker {cap}", field=field)


def create(
    session: Session,
    job: Job,
    batch_sizes: list[int],
    source: PlanSource,
    reason: str,
    *,
    by: str | None,
    predicted_ms: float | None = None,
    excluded: list[int] | None = None,
    memory_caps: list[int | None] | None = None,
) -> Plan:
    validate(job, batch_sizes)
    departed = sorted(job.departed)  # out for good: every plan keeps them out (``departures``)
    given = [r for r in departed if r < len(batch_sizes) and batch_sizes[r]]
    if given:
        raise Invalid(
            f"rank {given[0]} has left the job (its process is gone: see the job's departures); "
            "it cannot be given samples",
            field="batch_sizes",
        )
    excluded = sorted(set(excluded or []) | set(departed))
    if any(batch_sizes[r] for r in excluded if r < len(batch_sizes)) or any(
        r >= len(batch_sizes) for r in excluded
    ):
        raise Invalid("excluded ranks must exist and get 0 samples", field="excluded")
    if memory_caps is None and job.plan_version is not None:
        memory_caps = current(session, job.id).memory_caps  # caps stay unless a plan sets them
    version = (job.plan_version or 0) + 1
    plan = Plan(
        job_id=job.id,
        version=version,
        batch_sizes=list(batch_sizes),
        global_batch=job.job_spec.global_batch,
        source=source.value,
        reason=reason,
        predicted_ms=predicted_ms,
        created_by=by,
        excluded=excluded,
        departed=departed,
        memory_caps=memory_caps,
    )
    session.add(plan)
    job.plan_version = version
    session.flush()
    mark_plan_changed(session, job.id)
    return plan


def out_of_group(job: Job, plan: Plan) -> frozenset[int]:
    """Ranks ``plan`` keeps out of the all-reduce group for a while (the straggler ladder's
    partial all-reduce), not counting those that left the job for good. A plan made by anyone
    else (the rebalancer, an operator's override) keeps them out, with no samples, unless it
    brings one back on purpose: without that, an override readmitted a rank the ladder had
    taken out, and the ladder took it out again at its next round."""
    return frozenset(plan.excluded or []) - job.departed


def current(session: Session, job_id: int) -> Plan:
    version = session.scalar(select(Job.plan_version).where(Job.id == job_id))
    if version is None:
        if session.get(Job, job_id) is None:
            raise NotFound(f"job {job_id} not found")
        raise NotFound(f"job {job_id} has no plan yet (it is waiting for devices)")
    plan = session.scalars(select(Plan).where(Plan.job_id == job_id, Plan.version == version)).one()
    return plan


def current_many(session: Session, job_ids: Collection[int]) -> dict[int, Plan | NotFound]:
    """The plan in force of each job of ``job_ids``, in one read, or why there is none (as
    :func:`current` raises it)."""
    rows = session.execute(
        select(Job.id, Job.plan_version, Plan)
        .outerjoin(Plan, (Plan.job_id == Job.id) & (Plan.version == Job.plan_version))
        .where(Job.id.in_(sorted(job_ids)))
    )
    found: dict[int, Plan | NotFound] = {}
    for job_id, version, plan in rows:
        if version is None or plan is None:
            found[job_id] = NotFound(f"job {job_id} has no plan yet (it is waiting for devices)")
        else:
            found[job_id] = plan
    for job_id in job_ids:
        found.setdefault(job_id, NotFound(f"job {job_id} not found"))
    return found


_VERSIONS = select(Job.id, Job.plan_version).where(Job.id.in_(bindparam("job_ids", expanding=True)))


def current_versions(session: Session, job_ids: Collection[int]) -> dict[int, int | None]:
    """The version of each job's plan in force (None: no plan yet), in one read of the jobs'
    rows alone; a job not found is left out. A plan is never changed once committed (a new
    one takes the next version), so a plan already read is still the one in force while the
    version is the same (``routes.plans._load_current``)."""
    rows = session.execute(_VERSIONS, {"job_ids": sorted(job_ids)})
    return {job_id: version for job_id, version in rows}


def after(session: Session, job_id: int, version: int) -> list[Plan]:
    """The job's plans newer than ``version``, oldest first."""
    return list(
        session.scalars(
            select(Plan).where(Plan.job_id == job_id, Plan.version > version).order_by(Plan.version)
        )
    )


def history(session: Session, job_id: int, paging: Paging) -> tuple[list[Plan], int]:
    """A page of the job's plans, newest first."""
    if session.get(Job, job_id) is None:
        raise NotFound(f"job {job_id} not found")
    query = select(Plan).where(Plan.job_id == job_id).order_by(Plan.version.desc())
    return page(session, query, paging)
