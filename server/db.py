"""Engine, sessions and migrations. Nothing here is a module-level global: ``create_app`` builds
an engine from its settings, so tests build their own."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError
from sqlalchemy.sql import Executable

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).parent

log = logging.getLogger("evenflow.db")
T = TypeVar("T")


RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})
"""PostgreSQL aborted the transaction to break a deadlock, or to keep transactions
serializable: the same work again, from the start, may well succeed."""


class ReadChanged(Exception):
    """Rows a transaction read were gone when it read them again: on PostgreSQL (read
    committed) each statement sees every commit made before it, so another transaction's
    delete between two of them shows (a heartbeat read a rank as still to be launched, then
    read it again to mint its credential, and meanwhile the controller had restarted or
    cancelled its job). The whole transaction is worth running again (``run_retrying``): it
    then reads the rows as they are now."""


def retryable(exc: BaseException) -> bool:
    """A transaction the database aborted for another's sake (``RETRYABLE_SQLSTATES``), or
    whose rows another transaction deleted or changed between its read and its write (the
    ORM's ``StaleDataError``: a job's restart deleting the ranks a heartbeat was reporting;
    ``ReadChanged``: between two of its reads)."""
    if isinstance(exc, StaleDataError | ReadChanged):
        return True
    return isinstance(exc, DBAPIError) and (
        getattr(exc.orig, "sqlstate", None) in RETRYABLE_SQLSTATES
    )


def run_retrying(work: Callable[[], T], attempts: int, what: str) -> T:
    """``work()`` (a whole transaction: it changes nothing but the database), run again from
    the start when the database aborted it for another's sake (``retryable``), up to
    ``attempts`` times in all; any other error, or the last attempt's, is raised."""
    attempt = 1
    while True:
        try:
            return work()
        except (DBAPIError, StaleDataError, ReadChanged) as exc:
            if attempt >= attempts or not retryable(exc):
                raise
            log.info("%s aborted (%s); trying again", what, exc)
            attempt += 1


WAL_AUTOCHECKPOINT_PAGES = 16_384
"""SQLite: a commit checkpoints the WAL itself only past this many pages (64 MiB). The
controller checkpoints every round instead (``checkpoint``), in its own process, so the API's
commits, telemetry batches above all, do not pay for it."""


def make_engine(url: str, *, pool_size: int = 16, name: str = "evenflow") -> Engine:
    """An engine for ``url``; SQLite files get WAL mode, foreign keys and a busy timeout.

    On PostgreSQL its connections say who they are (``application_name``: ``name``, unless the
    URL names one: an operator's own name stays), so ``pg_stat_activity`` tells the API's
    backends from the controller's: what a database administrator looks at first to see who
    takes PostgreSQL's CPU."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=pool_size,
            max_overflow=2 * pool_size,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
            cur.close()

        return engine
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=2 * pool_size,
        pool_pre_ping=True,
        connect_args={}
        if "application_name" in make_url(url).query
        else {"application_name": name},
    )
    if engine.dialect.driver == "psycopg":
        event.listen(engine, "before_cursor_execute", _binary_results)
    return engine


BINARY_RESULTS = "evenflow_binary_results"
"""An execution option: psycopg hands this statement's rows over in PostgreSQL's binary format
(``driver_rows``). Parsing text is most of what fetching a row costs on both sides (the server
formats floats as text, the client parses them), and binary costs less on both."""


def _binary_results(
    _conn: Any, cursor: Any, _statement: str, _params: Any, context: Any, _many: bool
) -> None:
    if context is not None and context.execution_options.get(BINARY_RESULTS):
        cursor.format = psycopg.pq.Format.BINARY


def checkpoint(engine: Engine) -> None:
    """SQLite: copy committed WAL pages into the database file without blocking anyone
    (``PASSIVE``), so the WAL stays short; a no-op on other databases."""
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    cfg.attributes["engine"] = engine
    return cfg


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest migration."""
    command.upgrade(alembic_config(engine), "head")


def driver_rows(
    session: Session, statement: Executable, params: Mapping[str, Any]
) -> list[tuple[Any, ...]]:
    """The rows of ``statement`` in the session's transaction as the DBAPI driver hands them
    out: plain tuples, values as the driver converts them (on SQLite a boolean is 0 or 1). For
    the controller's hottest read (a sweep's new telemetry rows, thousands a job), where
    building a SQLAlchemy ``Row`` per row is a large share of reading them. Executed as any
    statement is (compiled once, the engine's events fired), only fetched from the cursor; on
    psycopg, in binary (``BINARY_RESULTS``: the same Python values)."""
    result = session.connection().execute(
        statement, dict(params), execution_options={BINARY_RESULTS: True}
    )
    try:
        return list(result.cursor.fetchall())
    finally:
        result.close()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose work is committed on success and rolled back on any error."""
    with factory() as session, session.begin():
        yield session
