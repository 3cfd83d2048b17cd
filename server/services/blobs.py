"""Bytes uploaded to the control plane, stored in the database a piece at a time.

A blob is named by the SHA-256 of its bytes, so the same bytes uploaded twice are stored once.
Its bytes live in ``blob_chunks`` (pieces of at most ``CHUNK_BYTES``): every server sharing the
database can serve it, and neither an upload nor a download ever holds more than a few pieces in
memory. Job code archives (``server.services.contexts``) and job outputs
(``server.services.artifacts``) are blobs.
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

from server.models import Blob, BlobChunk

if TYPE_CHECKING:
    from server.context import AppContext

CHUNK_BYTES = 256 << 10
"""The most bytes of a blob one database row holds (and one piece of a download)."""

READERS = anyio.CapacityLimiter(2)
"""Threads reading blobs at once, however many downloads run: each piece read on any of the
server's 40 worker threads left a thread's allocator holding its freed pieces (8 agents fetching
a 50 MiB archive grew the server by 70 MiB); two threads keep that to a few pieces."""


def store(
    app: AppContext, spool: IO[bytes], sha256: str, size: int, by: str, now: datetime
) -> tuple[Blob, bool]:
    """Store the bytes in ``spool`` (they hash to ``sha256``) unless they are there already;
    one transaction, one piece in memory at a time. The blob, and whether this call stored it
    (the same bytes uploaded twice at once are stored by one and found by the other)."""
    try:
        return _store(app, spool, sha256, size, by, now)
    except IntegrityError:  # another upload of the same bytes committed first
        with app.transaction(write=False) as session:
            found = session.get(Blob, sha256)
            if found is None:
                raise
            return found, False


def _store(
    app: AppContext, spool: IO[bytes], sha256: str, size: int, by: str, now: datetime
) -> tuple[Blob, bool]:
    with app.transaction(write=True) as session:
        found = session.get(Blob, sha256)
        if found is not None:
            return found, False
        row = Blob(sha256=sha256, size_bytes=size, chunks=0, created_at=now, created_by=by)
        session.add(row)  # visible to others, pieces and all, only once committed
        session.flush()
        spool.seek(0)
        while piece := spool.read(CHUNK_BYTES):
            session.add(BlobChunk(sha256=sha256, seq=row.chunks, data=piece))
            session.flush()  # one piece at a time goes to the database
            row.chunks += 1
        return row, True


async def read(app: AppContext, sha256: str) -> AsyncIterator[bytes]:
    """The blob's bytes, a piece at a time, each read in a short transaction of its own on one
    of ``READERS`` (a slow reader holds no connection between pieces); the digest is checked at
    the end."""
    count = await anyio.to_thread.run_sync(_pieces, app, sha256, limiter=READERS)
    digest = hashlib.sha256()
    for seq in range(count):
        piece = await anyio.to_thread.run_sync(_piece, app, sha256, seq, limiter=READERS)
        digest.update(piece)
        yield piece
    if count and digest.hexdigest() != sha256:
        raise RuntimeError(f"blob {sha256} is corrupt in the database")


def _pieces(app: AppContext, sha256: str) -> int:
    with app.transaction(write=False) as session:
        row = session.get(Blob, sha256)
        return 0 if row is None else row.chunks


def _piece(app: AppContext, sha256: str, seq: int) -> bytes:
    with app.transaction(write=False) as session:
        piece = session.scalar(
            select(BlobChunk.data).where(BlobChunk.sha256 == sha256, BlobChunk.seq == seq)
        )
    if piece is None:
        raise RuntimeError(f"blob {sha256} lost its piece {seq}")
    return bytes(piece)
