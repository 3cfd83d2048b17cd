"""Operators' manual overrides of a job's balancing. Each is previewed or applied, and every
applied one is recorded in the audit log with who and why."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from agent.wire import JobStatus, OverrideCreate, OverrideKind, OverrideOut, PlanOut, PlanSource
from server.errors import Conflict, Invalid
from server.models import Job, Override, Plan, utcnow
from server.services import plans
from server.services.audit import record
from server.services.tokens import Principal


def _new_batches(job: Job, req: OverrideCreate) -> list[int] | None:
    """The batch sizes an override asks for, or None if it does not change the plan."""
    if req.kind is OverrideKind.SET_BATCHES:
        if req.batch_sizes is None:
            raise Invalid("set_batches needs batch_sizes", field="batch_sizes")
        plans.validate(job, req.batch_sizes)
        return list(req.batch_sizes)
    if req.kind in (OverrideKind.FREEZE, OverrideKind.UNFREEZE):
        return None
    raise Invalid(
        f"override kind '{req.kind.value}' needs the rebalancer, not running on this server",
        field="kind",
    )


def submit(session: Session, job: Job, req: OverrideCreate, principal: Principal) -> OverrideOut:
    if JobStatus(job.status).terminal:
        raise Conflict(
            f"job {job.id} already {job.status}; overrides apply to live jobs", field="status"
        )
    batches = _new_batches(job, req)
    current: Plan | None = plans.current(session, job.id) if job.plan_version is not None else None
    payload = req.model_dump(mode="json", exclude={"kind", "reason", "preview"}, exclude_none=True)
    if req.preview:
        preview_plan = None
        if batches is not None:
            preview_plan = PlanOut(
                job_id=job.id,
                version=(job.plan_version or 0) + 1,
                batch_sizes=batches,
                global_batch=int(job.spec["global_batch"]),
                source=PlanSource.MANUAL,
                reason=req.reason,
                created_at=utcnow(),
                created_by=principal.name,
            )
        return OverrideOut(
            id=None,
            job_id=job.id,
            kind=req.kind,
            reason=req.reason,
            payload=payload,
            created_by=principal.name,
            created_at=None,
            applied=False,
            plan=preview_plan,
            current_predicted_ms=current.predicted_ms if current else None,
        )
    row = Override(
        job_id=job.id,
        kind=req.kind.value,
        reason=req.reason,
        payload=payload,
        created_by=principal.name,
        applied=True,
    )
    new_plan = None
    if req.kind is OverrideKind.FREEZE:
        job.frozen = True
    elif req.kind is OverrideKind.UNFREEZE:
        job.frozen = False
    if batches is not None:
        if job.plan_version is None:
            raise Conflict(f"job {job.id} has no workers yet", field="status")
        new_plan = plans.create(
            session, job, batches, PlanSource.MANUAL, f"manual: {req.reason}", by=principal.name
        )
        row.plan_version = new_plan.version
    session.add(row)
    session.flush()
    record(
        session,
        principal.name,
        f"override.{req.kind.value}",
        f"job:{job.id}",
        {"reason": req.reason, **payload, "plan_version": row.plan_version},
    )
    return OverrideOut(
        id=row.id,
        job_id=job.id,
        kind=req.kind,
        reason=req.reason,
        payload=payload,
        created_by=principal.name,
        created_at=row.created_at,
        applied=True,
        plan=PlanOut.model_validate(new_plan) if new_plan else None,
        current_predicted_ms=current.predicted_ms if current else None,
    )


def list_overrides(session: Session, job_id: int) -> list[Override]:
    return list(
        session.scalars(
            select(Override).where(Override.job_id == job_id).order_by(Override.id.desc())
        )
    )
