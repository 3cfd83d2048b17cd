"""Shared membership: a rank that is out of the all-reduce group and dies leaves the job for good
while the others go on, instead of restarting it.

Straggler exclusion (partial all-reduce: ``Plan.excluded``) and fault recovery share one notion
of who is in the job. An excluded rank trains nothing and nobody waits for it: the active ranks
all-reduce in a group of their own and reach it only through the rendezvous store. So when it
dies, the job can go on without it, at no restart, provided that

- the job is running (every rank reached the rendezvous and trains under an agreed plan),
- the rank is excluded under the plan in force,
- it is not rank 0, whose process holds the job's rendezvous store (the others' mailbox), and
- the ranks left are still at least the spec's ``workers`` (its minimum).

It then *departs*: its failure is recorded on the job (``Job.departures``, with the reason),
its device is given back (its process is gone), and a new plan, otherwise the same, names it
``departed``: every later plan keeps it excluded with no samples (``plans.create``), the
rebalancer, the straggler ladder and operators' overrides treat it as out, and the runtime
leaves it out of the job's end (the last re-synchronisation of excluded ranks). A job's
restart places every rank anew, so departures count for the attempt they happened in only.

Otherwise the failure restarts the job as any failure does (``jobs.fail_or_restart``), its
reason saying why the job could not go on without the rank. Should the runtime not yet have
switched to the plan that excluded the rank, the active ranks fail in their next collective
with the dead peer, and that failure restarts the job: the decision never leaves a job hanging.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import NamedTuple

from sqlalchemy.orm import Session

from contract.api import DepartureOut
from contract.enums import JobStatus, PlanSource
from server.models import Job
from server.services import plans
from server.services.audit import record


class Decision(NamedTuple):
    """Whether the job goes on without a rank that died, and if not, why (None: the rank was
    in the all-reduce group, which needs no more words)."""

    go_on: bool
    why: str | None = None


def decide(
    rank: int,
    *,
    running: bool,
    world_size: int,
    excluded: Collection[int],
    departed: Collection[int],
    min_workers: int,
) -> Decision:
    """Whether the job can go on without ``rank``, which just died (see the module). Pure."""
    if rank not in excluded:
        return Decision(False)
    if not running:
        return Decision(False, "it was out of the all-reduce group, but the job was starting")
    if rank == 0:
        return Decision(
            False, "it was out of the all-reduce group, but rank 0 holds the job's rendezvous"
        )
    left = world_size - len(set(departed) | {rank})
    if left < min_workers:
        return Decision(
            False,
            f"it was out of the all-reduce group, but the {left} rank(s) left are fewer than "
            f"the job's minimum of {min_workers} workers",
        )
    return Decision(True)


def decide_for(session: Session, job: Job, rank: int) -> Decision:
    """``decide`` for a rank of ``job`` under the plan in force."""
    excluded = (plans.current(session, job.id).excluded or []) if job.plan_version else []
    return decide(
        rank,
        running=JobStatus(job.status) is JobStatus.RUNNING,
        world_size=len(job.workers),
        excluded=excluded,
        departed=job.departed,
        min_workers=job.job_spec.world_size,
    )


def depart(session: Session, job: Job, rank: int, reason: str, now: datetime) -> None:
    """Record that ``rank`` left the job for good and make the plan that says so."""
    entry = DepartureOut(rank=rank, attempt=job.attempt, at=now, reason=reason)
    job.departures = [*(job.departures or []), entry.model_dump(mode="json")]
    current = plans.current(session, job.id)
    plan = plans.create(
        session,
        job,
        list(current.batch_sizes),
        PlanSource.AUTOMATIC,
        f"rank {rank} left the job ({reason}); it was out of the all-reduce group, so the "
        "others go on without it",
        by="system",
        predicted_ms=current.predicted_ms,
        excluded=list(current.excluded or []),
    )
    record(
        session,
        "system",
        "job.departure",
        f"job:{job.id}",
        {**entry.model_dump(mode="json"), "plan_version": plan.version},
    )
