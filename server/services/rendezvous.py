"""Where a job's ranks meet: rank 0's address and the port its rendezvous store bound.

The control plane no longer chooses the port (a port chosen ahead can be held by a stale
process or another job on rank 0's host). Rank 0's worker binds a port the OS gives as free,
publishes it here with its own credential, and the job's other ranks read it here before they
connect (``agent.runtime.rendezvous``).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from contract.agent import RendezvousIn, RendezvousOut
from contract.enums import JobStatus, Role
from server.errors import Conflict, Forbidden
from server.models import Job
from server.services import jobs
from server.services.tokens import Principal


def _live(session: Session, job_id: int) -> Job:
    job = jobs.get(session, job_id)
    if JobStatus(job.status).terminal:
        raise Conflict(f"job {job_id} has ended ({job.status})", field="status")
    return job


def lookup(session: Session, job_id: int) -> RendezvousOut:
    """Rank 0's address and port (None until published); 409 once the job has ended."""
    job = _live(session, job_id)
    return RendezvousOut(
        job_id=job.id, address=jobs.rank0_address(session, job), port=job.master_port
    )


def publish(
    session: Session, job_id: int, body: RendezvousIn, principal: Principal
) -> RendezvousOut:
    """Rank 0's worker records the port it bound; only once (the same port again is a no-op)."""
    if principal.role is not Role.WORKER or principal.job_id != job_id or principal.rank != 0:
        raise Forbidden(
            f"only the rank 0 worker credential of job {job_id} publishes its rendezvous port; "
            f"'{principal.name}' is not it"
        )
    job = _live(session, job_id)
    if job.master_port is not None and job.master_port != body.port:
        raise Conflict(f"job {job_id}'s rendezvous port is already {job.master_port}", field="port")
    job.master_port = body.port
    session.flush()
    return lookup(session, job_id)
