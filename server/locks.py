"""Locks shared by every server process on one database.

Two are needed once the control loop runs in a process of its own (``server.controller``):

- :class:`WriterLock`: SQLite allows one writer at a time. A writer that finds the database
  locked falls into SQLite's busy handler, which sleeps and retries with a growing back-off
  (up to 100 ms a sleep), so a short write can wait far longer than the write it waits for.
  Writers therefore queue on a lock instead: a ``threading.Lock`` inside a process and an
  ``fcntl.flock`` on a file beside the database across processes, which hands the database
  on as soon as the writer before is done. PostgreSQL needs none.
- :func:`bootstrap_lock`: one server at a time migrates and bootstraps a database, so replicas
  starting together (a Kubernetes Deployment) do not run Alembic concurrently.
- :class:`ControllerLock`: exactly one control loop per database. On SQLite an exclusive
  ``flock`` beside the database file, on PostgreSQL a session advisory lock held on a connection
  of its own. Both are released by the kernel or the server when the holder dies, so a standby
  controller takes over.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from sqlalchemy import Connection, Engine, make_url, text

log = logging.getLogger("evenflow.locks")

# The PostgreSQL advisory lock key of the controller: b"evenflow" as a signed 64-bit integer.
CONTROLLER_LOCK_KEY = int.from_bytes(b"evenflow", "big", signed=True)
# The key servers take while they migrate and bootstrap: b"ef-boot!".
BOOTSTRAP_LOCK_KEY = int.from_bytes(b"ef-boot!", "big", signed=True)
# The key every telemetry insert takes, to its commit: b"ef-telem" (``telemetry.ingest_many``).
TELEMETRY_ORDER_LOCK_KEY = int.from_bytes(b"ef-telem", "big", signed=True)


@contextmanager
def bootstrap_lock(engine: Engine) -> Iterator[None]:
    """Held while migrating and bootstrapping: a PostgreSQL advisory lock (waited for) on a
    connection of its own; on SQLite the migration's own write transaction serialises."""
    if engine.dialect.name != "postgresql":
        yield
        return
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": BOOTSTRAP_LOCK_KEY})
        conn.commit()
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": BOOTSTRAP_LOCK_KEY})
            conn.commit()


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL (absolute), or None (in-memory, or not SQLite)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    return Path(u.database).resolve()


class WriterLock:
    """One writer at a time: across threads (always) and across processes (with ``path``)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked child opens its own
            assert self.path is not None
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()
        return self._fd

    def __enter__(self) -> WriterLock:
        self._thread_lock.acquire()
        if self.path is not None:
            try:
                fcntl.flock(self._file(), fcntl.LOCK_EX)
            except BaseException:
                self._thread_lock.release()
                raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.path is not None and self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def close(self) -> None:
        """Close the lock file (the app's shutdown); a later use opens it again."""
        with self._thread_lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None


def writer_lock_for(url: str) -> WriterLock | None:
    """The writer lock a database needs: SQLite files get one beside them, PostgreSQL none."""
    if make_url(url).get_backend_name() != "sqlite":
        return None
    db = sqlite_file(url)
    return WriterLock(None if db is None else db.with_name(db.name + ".writer.lock"))


class ControllerLock:
    """Held by the one active controller of a database; :meth:`try_acquire` never blocks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._db = sqlite_file(engine.url.render_as_string(hide_password=False))
        self._fd: int | None = None
        self._conn: Connection | None = None
        self._local = False
        self.held = False

    def try_acquire(self) -> bool:
        if self.held:
            return True
        if self.engine.dialect.name == "postgresql":
            conn = self.engine.connect()
            got = bool(
                conn.execute(
                    text("SELECT pg_try_advisory_lock(:k)"), {"k": CONTROLLER_LOCK_KEY}
                ).scalar()
            )
            conn.commit()
            if got:
                self._conn = conn
            else:
                conn.close()
            self.held = got
        elif self._db is not None:
            fd = os.open(
                self._db.with_name(self._db.name + ".controller.lock"),
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                0o600,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            self._fd = fd
            self.held = True
        else:  # an in-memory database lives in this process only: nobody else can run a loop
            self.held = True
        return self.held

    def check(self) -> None:
        """Raise if the lock was lost (its PostgreSQL connection broke)."""
        if self._conn is not None:
            self._conn.execute(text("SELECT 1"))
            self._conn.commit()

    def release(self) -> None:
        if self._conn is not None:
            try:
                self._conn.execute(
                    text("SELECT pg_advisory_unlock(:k)"), {"k": CONTROLLER_LOCK_KEY}
                )
                self._conn.commit()
            except Exception:  # a broken connection has released it already
                log.debug("advisory unlock failed", exc_info=True)
            finally:
                self._conn.close()
                self._conn = None
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None
        self.held = False
