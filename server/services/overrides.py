"""Operators' manual overrides of a job's balancing.

Each is previewed (``preview: true``: the plan it would make and its predicted iteration time
next to the current one, nothing stored) or applied: stored, recorded in the audit log with who
and why, and served to the workers, who switch at their next iteration boundary.

=============== ================================================================================
set_batches     a plan by hand (sums to B, caps respected); freezes automatic rebalancing so the
                planner does not undo it (unfreeze to hand control back)
pin             one rank's batch is fixed; the planner solves the rest, now and later
exclude         a rank gets 0 samples (it still joins the all-reduce); the others take its share
readmit         undo exclude (and any pin) for a rank, or bring back into the all-reduce group a
                rank the straggler ladder took out of it
freeze/unfreeze suspend / resume automatic rebalancing
rebalance_now   re-plan from the current models at once, whatever the gain
=============== ================================================================================

Pins and exclusions are standing controls (``Job.controls``): the rebalancer treats them as
constraints, so an operator's decision always wins over the automatic loop.

A rank the straggler ladder took out of the all-reduce group (``Plan.excluded``) stays out of
an override's plan, with no samples, unless the override brings it back: a readmit or a pin
above 0 of that rank, an operator's exclusion of it (which keeps it in the group at 0 samples,
as the ladder reads it), or a hand-made plan that gives it samples.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.agent import PlanOut
from contract.api import OverrideCreate, OverrideOut
from contract.enums import JobStatus, OverrideKind, PlanSource
from server.errors import Conflict, Invalid
from server.models import Job, Override, Plan, utcnow
from server.planner import Infeasible
from server.planner.rebalance import RebalanceDecision, makespan
from server.services import memory, plans, rebalancer
from server.services.audit import record
from server.services.paging import Paging, page
from server.services.tokens import Principal

REPLANS = (OverrideKind.PIN, OverrideKind.EXCLUDE, OverrideKind.READMIT, OverrideKind.REBALANCE_NOW)


def _rank(job: Job, req: OverrideCreate) -> int:
    if req.rank is None:
        raise Invalid(f"{req.kind.value} needs a rank", field="rank")
    if req.rank >= len(job.workers):
        raise Invalid(
            f"rank {req.rank} does not exist; job {job.id} has {len(job.workers)} workers",
            field="rank",
        )
    if req.rank in job.departed:
        raise Invalid(
            f"rank {req.rank} has left job {job.id} (its process is gone: see the job's "
            "departures); it is out of the job until a restart places it again",
            field="rank",
        )
    return req.rank


def _new_controls(
    job: Job, req: OverrideCreate, out: frozenset[int]
) -> tuple[dict[int, int], frozenset[int]]:
    """The job's pins and operator exclusions once ``req`` applies; ``out``: the ranks out of
    the all-reduce group under the plan in force."""
    pins, excluded = rebalancer.controls(job)
    pins, excl = dict(pins), set(excluded)
    if req.kind is OverrideKind.PIN:
        rank = _rank(job, req)
        if req.batch_size is None:
            raise Invalid("pin needs batch_size", field="batch_size")
        spec = job.job_spec
        b, g = req.batch_size, spec.policy.granularity
        if b > spec.global_batch:
            raise Invalid(
                f"batch_size {b} exceeds the global batch {spec.global_batch}",
                field="batch_size",
            )
        if b % g:
            raise Invalid(
                f"batch_size {b} is not a multiple of the granularity {g}", field="batch_size"
            )
        pins[rank] = b
        excl.discard(rank)
    elif req.kind is OverrideKind.EXCLUDE:
        rank = _rank(job, req)
        excl.add(rank)
        pins.pop(rank, None)
        if len(excl | job.departed) == len(job.workers):
            raise Invalid("cannot exclude every worker", field="rank")
    elif req.kind is OverrideKind.READMIT:
        rank = _rank(job, req)
        if rank not in excl and rank not in pins and rank not in out:
            raise Invalid(
                f"rank {rank} is neither excluded, pinned nor out of the all-reduce group",
                field="rank",
            )
        excl.discard(rank)
        pins.pop(rank, None)
    return pins, frozenset(excl)


def _check_memory(session: Session, job: Job, req: OverrideCreate) -> None:
    """Refuse a pin or a hand-made plan that gives a rank more than its memory cap."""
    if req.kind is OverrideKind.PIN and req.rank is not None and req.batch_size is not None:
        asked = {req.rank: (req.batch_size, "batch_size")}
    elif req.kind is OverrideKind.SET_BATCHES and req.batch_sizes is not None:
        asked = {r: (b, f"batch_sizes.{r}") for r, b in enumerate(req.batch_sizes)}
    else:
        return
    for m in memory.ranks(session, job):
        if m.rank not in asked or m.cap is None:
            continue
        b, field = asked[m.rank]
        if b > m.cap:
            raise Invalid(
                f"{field}: {b} samples exceed rank {m.rank}'s memory cap of {m.cap} per pass "
                f"({_cap_reason(m)})",
                field=field,
            )


def _cap_reason(m: memory.RankMemory) -> str:
    parts = []
    model = m.fit.usable if m.fit else None
    if model is not None and m.device_mb:
        parts.append(
            f"predicted {model.predict(m.cap or 0):.0f} MB of {m.device_mb} MB with "
            f"{m.headroom:.0%} headroom, mem(b) = {model.base_mb:.0f} + "
            f"{model.per_sample_mb:.3g} * b"
        )
    if m.oom_batch is not None:
        parts.append(f"a pass of {m.oom_batch} ran out of memory")
    return "; ".join(parts)


@dataclass(frozen=True)
class _Outcome:
    """What an override that re-plans decides: its plan, the job's controls after it, and the
    ranks its plan keeps out of the all-reduce group (``held_out``)."""

    decision: RebalanceDecision
    pins: dict[int, int]
    excluded: frozenset[int]
    held_out: frozenset[int]


def _held_out(
    req: OverrideCreate, out: frozenset[int], pins: dict[int, int], excluded: frozenset[int]
) -> frozenset[int]:
    """The ranks out of the all-reduce group now that stay out under the override's plan."""
    if req.kind is OverrideKind.SET_BATCHES:
        sizes = req.batch_sizes or []
        return frozenset(r for r in out if r < len(sizes) and sizes[r] == 0)
    back = {req.rank} if req.kind is OverrideKind.READMIT else set()
    return frozenset(r for r in out if pins.get(r, 0) == 0 and r not in excluded | back)


def _decide(session: Session, job: Job, req: OverrideCreate, current: Plan) -> _Outcome:
    out = plans.out_of_group(job, current)
    pins, excluded = _new_controls(job, req, out)
    held = _held_out(req, out, pins, excluded)
    _check_memory(session, job, req)
    try:
        if req.kind is OverrideKind.SET_BATCHES:
            if req.batch_sizes is None:
                raise Invalid("set_batches needs batch_sizes", field="batch_sizes")
            plans.validate(job, list(req.batch_sizes))
            base = rebalancer.propose(session, job, force=True)
            sizes = tuple(req.batch_sizes)
            manual = RebalanceDecision(
                sizes,
                f"manual: {req.reason}",
                makespan(base.models, sizes, base.memory_caps),
                base.current_predicted_ms,
                base.exploring,
                base.models,
                base.memory_caps,
            )
            return _Outcome(manual, pins, excluded, held)
        decision = rebalancer.propose(session, job, force=True, pins=pins, excluded=excluded | held)
        if decision.batch_sizes is None and held != out:
            # The same split, but a rank back in the all-reduce group: still a new plan.
            back = ", ".join(str(r) for r in sorted(out - held))
            decision = replace(
                decision,
                batch_sizes=tuple(current.batch_sizes),
                reason=f"rank(s) {back} back in the all-reduce group; {decision.reason}",
            )
    except Infeasible as exc:
        raise Invalid(
            f"{req.kind.value} cannot hold: {exc}", field="rank" if req.rank is not None else "kind"
        ) from exc
    return _Outcome(decision, pins, excluded, held)


def submit(session: Session, job: Job, req: OverrideCreate, principal: Principal) -> OverrideOut:
    """Preview (``req.preview``) or apply an override of a live, placed job."""
    _require_live(job)
    payload = req.model_dump(mode="json", exclude={"kind", "reason", "preview"}, exclude_none=True)
    current = plans.current(session, job.id)
    outcome: _Outcome | None = None
    if req.kind is OverrideKind.SET_BATCHES or req.kind in REPLANS:
        outcome = _decide(session, job, req, current)
    current_ms = outcome.decision.current_predicted_ms if outcome else current.predicted_ms
    if req.preview:
        plan = _preview_plan(job, current, outcome, principal)
        return OverrideOut(
            id=None,
            job_id=job.id,
            kind=req.kind,
            reason=req.reason,
            payload=payload,
            created_by=principal.name,
            created_at=None,
            applied=False,
            plan=plan,
            current_predicted_ms=current_ms,
        )
    row, new_plan = _apply(session, job, req, payload, outcome, principal)
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
        current_predicted_ms=current_ms,
    )


def _require_live(job: Job) -> None:
    if JobStatus(job.status).terminal:
        raise Conflict(
            f"job {job.id} already {job.status}; overrides apply to live jobs", field="status"
        )
    if job.plan_version is None:
        raise Conflict(
            f"job {job.id} has no workers yet; overrides apply once it is placed", field="status"
        )


def _preview_plan(
    job: Job, current: Plan, outcome: _Outcome | None, principal: Principal
) -> PlanOut | None:
    """The plan an override would make (nothing stored), or None when it makes none."""
    if outcome is None or outcome.decision.batch_sizes is None:
        return None
    decision, sizes = outcome.decision, outcome.decision.batch_sizes
    return PlanOut(
        job_id=job.id,
        version=current.version + 1,
        batch_sizes=list(sizes),
        excluded=sorted(outcome.held_out | job.departed),
        departed=sorted(job.departed),
        global_batch=current.global_batch,
        source=PlanSource.MANUAL,
        reason=decision.reason,
        predicted_ms=decision.predicted_ms,
        created_at=utcnow(),
        created_by=principal.name,
        memory_caps=list(decision.memory_caps) or current.memory_caps,
    )


def _apply(
    session: Session,
    job: Job,
    req: OverrideCreate,
    payload: dict[str, Any],
    outcome: _Outcome | None,
    principal: Principal,
) -> tuple[Override, Plan | None]:
    """Store the override, update the job's flags and controls, commit its plan (if it makes
    one) and record it in the audit log."""
    row = Override(
        job_id=job.id,
        kind=req.kind,
        reason=req.reason,
        payload=payload,
        created_by=principal.name,
        applied=True,
    )
    _update_job_controls(job, req.kind, outcome)
    new_plan = None
    if outcome is not None and outcome.decision.batch_sizes is not None:
        decision, sizes = outcome.decision, outcome.decision.batch_sizes
        reason = (
            decision.reason
            if req.kind is OverrideKind.SET_BATCHES
            else f"{req.kind.value}: {req.reason}; {decision.reason}"
        )
        new_plan = plans.create(
            session,
            job,
            list(sizes),
            PlanSource.MANUAL,
            reason,
            by=principal.name,
            predicted_ms=decision.predicted_ms,
            excluded=sorted(outcome.held_out),
            memory_caps=list(decision.memory_caps) or None,
        )
        row.plan_version = new_plan.version
    session.add(row)
    session.flush()
    detail = {
        "reason": req.reason,
        **payload,
        "plan_version": row.plan_version,
        "frozen": job.frozen,
    }
    record(session, principal.name, f"override.{req.kind.value}", f"job:{job.id}", detail)
    return row, new_plan


def _update_job_controls(job: Job, kind: OverrideKind, outcome: _Outcome | None) -> None:
    if kind is OverrideKind.FREEZE:
        job.frozen = True
    elif kind is OverrideKind.UNFREEZE:
        job.frozen = False
    elif kind is OverrideKind.SET_BATCHES:
        job.frozen = True  # otherwise the next automatic round would undo the operator's plan
    if outcome is not None and kind in (
        OverrideKind.PIN,
        OverrideKind.EXCLUDE,
        OverrideKind.READMIT,
    ):
        job.controls = {
            "pins": {str(r): b for r, b in sorted(outcome.pins.items())},
            "excluded": sorted(outcome.excluded),
        }


def list_overrides(session: Session, job_id: int, paging: Paging) -> tuple[list[Override], int]:
    query = select(Override).where(Override.job_id == job_id).order_by(Override.id.desc())
    return page(session, query, paging)
