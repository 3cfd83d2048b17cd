"""Code archives uploaded for jobs: stored in the database a piece at a time, read back the same.

An archive is named by the SHA-256 of its bytes, so the same code uploaded twice is stored once
and a job's spec names exactly what it runs. Its bytes live in ``context_chunks`` (pieces of at
most ``CHUNK_BYTES``): every server sharing the database can serve it, and neither an upload nor
a download ever holds more than one piece in memory. Operators upload and read archives; an
agent reads those of the jobs placed on its host.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from datetime import datetime
from typing import IO, TYPE_CHECKING

import anyio
import anyio.to_thread
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contract.api import ContextOut
from contract.enums import Role
from server.errors import Forbidden, Invalid, NotFound
from server.models import Context, ContextChunk, Host, Job, Worker
from server.services.audit import record
from server.services.tokens import Principal

if TYPE_CHECKING:
    from server.context import AppContext

CHUNK_BYTES = 256 << 10
"""The most bytes of an archive one database row holds (and one piece of a download)."""

READERS = anyio.CapacityLimiter(2)
"""Threads reading archives at once, however many downloads run: each piece read on any of the
server's 40 worker threads left a thread's allocator holding its freed pieces (8 agents fetching
a 50 MiB archive grew the server by 70 MiB); two threads keep that to a few pieces."""


def store(
    app: AppContext, spool: IO[bytes], sha256: str, size: int, principal: Principal, now: datetime
) -> ContextOut:
    """Store the archive in ``spool`` (its bytes hash to ``sha256``) unless it is there already;
    one transaction, one piece in memory at a time. The same bytes uploaded twice at once are
    stored by one and found by the other."""
    try:
        return _store(app, spool, sha256, size, principal, now)
    except IntegrityError:  # another upload of the same bytes committed first
        with app.transaction(write=False) as session:
            found = session.get(Context, sha256)
            if found is None:
                raise
            return _out(found, new=False)


def _store(
    app: AppContext, spool: IO[bytes], sha256: str, size: int, principal: Principal, now: datetime
) -> ContextOut:
    with app.transaction(write=True) as session:
        found = session.get(Context, sha256)
        if found is not None:
            return _out(found, new=False)
        row = Context(
            sha256=sha256, size_bytes=size, chunks=0, created_at=now, created_by=principal.name
        )
        session.add(row)  # visible to others, pieces and all, only once committed
        session.flush()
        spool.seek(0)
        while piece := spool.read(CHUNK_BYTES):
            session.add(ContextChunk(sha256=sha256, seq=row.chunks, data=piece))
            session.flush()  # one piece at a time goes to the database
            row.chunks += 1
        record(session, principal.name, "context.upload", f"context:{sha256}", {"bytes": size})
        return _out(row, new=True)


def info(session: Session, sha256: str, principal: Principal) -> ContextOut:
    """The archive's size and origin (404 when there is none: upload it first)."""
    return _out(_readable(session, sha256, principal), new=False)


async def read(app: AppContext, sha256: str) -> AsyncIterator[bytes]:
    """The archive's bytes, a piece at a time, each read in a short transaction of its own on
    one of ``READERS`` (a slow reader holds no connection between pieces); the digest is
    checked at the end."""
    count = await anyio.to_thread.run_sync(_pieces, app, sha256, limiter=READERS)
    digest = hashlib.sha256()
    for seq in range(count):
        piece = await anyio.to_thread.run_sync(_piece, app, sha256, seq, limiter=READERS)
        digest.update(piece)
        yield piece
    if count and digest.hexdigest() != sha256:
        raise RuntimeError(f"context {sha256} is corrupt in the database")


def _pieces(app: AppContext, sha256: str) -> int:
    with app.transaction(write=False) as session:
        row = session.get(Context, sha256)
        return 0 if row is None else row.chunks


def _piece(app: AppContext, sha256: str, seq: int) -> bytes:
    with app.transaction(write=False) as session:
        piece = session.scalar(
            select(ContextChunk.data).where(ContextChunk.sha256 == sha256, ContextChunk.seq == seq)
        )
    if piece is None:
        raise RuntimeError(f"context {sha256} lost its piece {seq}")
    return bytes(piece)


def check_readable(session: Session, sha256: str, principal: Principal) -> None:
    """404 when no such archive exists; 403 unless the caller may read it."""
    _readable(session, sha256, principal)


def require(session: Session, sha256: str) -> None:
    """A job may name only an archive that was uploaded (422 naming ``workload.context``)."""
    if session.get(Context, sha256) is None:
        raise Invalid(
            f"no context with sha256 {sha256} was uploaded: upload it first "
            "(evenflow jobs submit --context DIR does both)",
            field="workload.context",
        )


def _readable(session: Session, sha256: str, principal: Principal) -> Context:
    row = session.get(Context, sha256)
    if row is None:
        raise NotFound(f"no context with sha256 {sha256}", field="sha256")
    if principal.role is Role.AGENT:
        placed = session.scalar(
            select(Worker.id)
            .join(Job, Worker.job_id == Job.id)
            .join(Host, Worker.host_id == Host.id)
            .where(Job.context == sha256, Host.name == principal.host)
            .limit(1)
        )
        if placed is None:
            raise Forbidden(
                f"agent '{principal.host}' runs no job of context {sha256[:12]}",
                field="sha256",
            )
        return row
    principal.require(Role.OPERATOR)
    return row


def _out(row: Context, *, new: bool) -> ContextOut:
    return ContextOut(
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        created_by=row.created_by,
        new=new,
    )
