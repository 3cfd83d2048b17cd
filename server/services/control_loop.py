"""The control loop: one round over every live job, run by the server every
``rebalance_interval_s``. The rebalancer re-plans on its cadence (``server.services.rebalancer``);
when it makes no plan this round, the straggler watch looks at the new iterations
(``server.services.stragglers``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from agent.wire import JobStatus, PlanSource
from server.models import Job
from server.services import rebalancer
from server.services.audit import record
from server.services.rebalancer import LastDecision
from server.services.stragglers import Watch, watch_job


def sweep(
    session: Session, memo: dict[int, LastDecision], watches: dict[int, Watch] | None = None
) -> list[tuple[int, int]]:
    """One round over live jobs; returns (job id, new plan version) for every plan made.

    ``memo`` carries each job's last decision between rounds (losing it on restart costs one
    early decision). With ``watches``, the straggler watch runs too: events for every job,
    and the mitigation ladder for ``adaptive`` ones."""
    made: list[tuple[int, int]] = []
    live = list(
        session.scalars(
            select(Job).where(Job.status.in_((JobStatus.STARTING.value, JobStatus.RUNNING.value)))
        )
    )
    live_ids = {job.id for job in live}
    for job in live:
        planned = _rebalance(session, job, memo)
        if planned is not None:
            made.append((job.id, planned))
        elif watches is not None:
            last = memo.get(job.id)
            settled = last is not None and not last.exploring
            version = watch_job(session, job, watches.setdefault(job.id, Watch()), mitigate=settled)
            if version is not None:
                made.append((job.id, version))
    for job_id in set(watches or ()) - live_ids:  # ended jobs
        (watches or {}).pop(job_id, None)
    return made


def _rebalance(session: Session, job: Job, memo: dict[int, LastDecision]) -> int | None:
    p = rebalancer.due(session, job, memo.get(job.id))
    if p is None or p.complete_through is None:
        return None
    last = memo.get(job.id)
    decision = rebalancer.propose(
        session, job, current_from_guesses=last is not None and last.exploring
    )
    memo[job.id] = LastDecision(p.complete_through, decision.exploring)
    version = rebalancer.apply(session, job, decision, PlanSource.AUTOMATIC, by="rebalancer")
    if version is not None:
        record(
            session,
            "rebalancer",
            "plan.automatic",
            f"job:{job.id}",
            {"version": version, "reason": decision.reason},
        )
    return version
