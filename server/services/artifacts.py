"""What a job left: the files its ranks wrote to their output directories, and their final
models.

Each rank reports its files when it ends (name, size, where: ``report``). One on its host's own
disk (the default) uploads a copy of the bytes too (``store``), kept as a blob, so anyone who may
read the job can download it through the server (``content``); the copies a job keeps there add
up to at most ``EVENFLOW_ARTIFACT_MAX_BYTES``. A file on shared storage (a shared path, an object
store) is only listed: its readers reach it where it is.
"""

from __future__ import annotations

from datetime import datetime
from typing import IO, TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contract.agent import ArtifactReport
from contract.api import ArtifactOut
from server.errors import Invalid, NotFound
from server.models import Artifact, Blob, Host, Worker
from server.services import blobs, jobs, rank_reports
from server.services.paging import Paging, page
from server.services.tokens import Principal

if TYPE_CHECKING:
    from server.context import AppContext


class TooLarge(Invalid):
    status_code = 413


def report(
    session: Session, job_id: int, body: ArtifactReport, principal: Principal, now: datetime
) -> ArtifactOut:
    """Record a file a rank left (its own credential, its host's agent, or an admin); a second
    report of the same name by the same rank replaces the first."""
    job = jobs.get(session, job_id)
    rank_reports.check_may_write_ranks(session, principal, job_id, [body.rank], "report artifacts")
    row = session.scalar(
        select(Artifact).where(
            Artifact.job_id == job_id, Artifact.rank == body.rank, Artifact.name == body.name
        )
    )
    if row is None:
        row = Artifact(job_id=job_id, rank=body.rank, name=body.name)
        session.add(row)
    row.attempt, row.size_bytes, row.url = job.attempt, body.size_bytes, body.url
    row.host = None if body.shared else _host_of(session, job_id, body.rank)
    row.blob, row.created_at = None, now
    session.flush()
    return _out(row)


def get(session: Session, job_id: int, artifact_id: int) -> Artifact:
    row = session.get(Artifact, artifact_id)
    if row is None or row.job_id != job_id:
        raise NotFound(f"job {job_id} has no artifact {artifact_id}", field="artifact_id")
    return row


def check_may_store(
    session: Session, job_id: int, artifact_id: int, principal: Principal, size: int, limit: int
) -> None:
    """Before an upload: the rank's own credential (or its agent, an admin), and room for it
    within the job's limit (413 naming it)."""
    row = get(session, job_id, artifact_id)
    rank_reports.check_may_write_ranks(session, principal, job_id, [row.rank], "upload artifacts")
    if row.host is None:
        raise Invalid(
            f"artifact {artifact_id} is on shared storage ({row.url}): it is read there",
            field="artifact_id",
        )
    held = session.scalar(
        select(func.coalesce(func.sum(Blob.size_bytes), 0))
        .select_from(Artifact)
        .join(Blob, Artifact.blob == Blob.sha256)
        .where(Artifact.job_id == job_id, Artifact.id != artifact_id)
    )
    if int(held or 0) + size > limit:
        raise TooLarge(
            f"job {job_id} keeps at most {limit} bytes of artifacts on the server "
            f"(EVENFLOW_ARTIFACT_MAX_BYTES); {held} are kept, this one is {size}",
            field="body",
        )


def store(
    app: AppContext,
    job_id: int,
    artifact_id: int,
    spool: IO[bytes],
    sha256: str,
    size: int,
    principal: Principal,
    now: datetime,
) -> ArtifactOut:
    """Keep the bytes of an artifact (checked by ``check_may_store``) as a blob."""
    blobs.store(app, spool, sha256, size, principal.name, now)
    with app.transaction(write=True) as session:
        row = get(session, job_id, artifact_id)
        if size != row.size_bytes:
            raise Invalid(
                f"artifact {artifact_id} was reported as {row.size_bytes} bytes, {size} came",
                field="body",
            )
        row.blob = sha256
        return _out(row)


def list_for(session: Session, job_id: int, paging: Paging) -> tuple[list[ArtifactOut], int]:
    """A page of a job's artifacts, by rank and name."""
    jobs.get(session, job_id)
    query = (
        select(Artifact)
        .where(Artifact.job_id == job_id)
        .order_by(Artifact.rank, Artifact.name, Artifact.id)
    )
    rows, total = page(session, query, paging)
    return [_out(r) for r in rows], total


def stored_blob(session: Session, job_id: int, artifact_id: int) -> tuple[str, str]:
    """(blob, file name) of an artifact whose bytes the server holds (404 otherwise)."""
    row = get(session, job_id, artifact_id)
    if row.blob is None:
        where = f"on host {row.host} at {row.url}" if row.host else f"at {row.url}"
        raise NotFound(
            f"the server holds no copy of artifact {artifact_id} ({row.name}); it is {where}",
            field="artifact_id",
        )
    return row.blob, row.name.rpartition("/")[2]


def _host_of(session: Session, job_id: int, rank: int) -> str | None:
    return session.scalar(
        select(Host.name)
        .join(Worker, Worker.host_id == Host.id)
        .where(Worker.job_id == job_id, Worker.rank == rank)
    )


def _out(row: Artifact) -> ArtifactOut:
    return ArtifactOut(
        id=row.id,
        job_id=row.job_id,
        attempt=row.attempt,
        rank=row.rank,
        name=row.name,
        size_bytes=row.size_bytes,
        url=row.url,
        host=row.host,
        stored=row.blob is not None,
        created_at=row.created_at,
    )
